"""meshserve.launch"""
