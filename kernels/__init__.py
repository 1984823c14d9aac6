"""Triton kernels and their PyTorch references.

Deliberately free of imports: if this folder is ever importable as a bare top-level
`kernels` (a repository checkout on sys.path), transformers' probe for its own
`kernels` package imports it; it must then do nothing.
"""
