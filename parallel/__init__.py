"""meshserve.parallel"""
