"""meshserve.models"""
