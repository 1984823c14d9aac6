"""Triton kernels and their PyTorch references.

Installed as `meshserve.kernels`. A repository checkout on sys.path (`python -m` or
`python -c` run from its root) also makes this folder importable as a bare top-level
`kernels`, the name of Hugging Face's kernel-hub package, which transformers imports
when it is installed. Imported under that bare name, this module hands the name to the
installed package, if there is one, and otherwise does nothing.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # the import statement returns what is here
        _spec.loader.exec_module(_module)
