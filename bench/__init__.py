"""meshserve.bench"""
