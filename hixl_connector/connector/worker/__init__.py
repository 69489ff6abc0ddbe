"""The worker half (every worker process): registers the KV caches, reads on D, serves P's
side channel.
"""
