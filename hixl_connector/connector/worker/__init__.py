"""The worker half (every worker process): registers the KV caches, reads on D, serves P's
side channel, and hands push mode's requests to the push wing.
"""
