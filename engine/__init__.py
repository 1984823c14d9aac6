"""meshserve.engine"""
