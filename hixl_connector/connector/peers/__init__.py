"""Peers: the side channel to each prefill rank (envelope, sockets), the handshake, and the
registry of links with their lifecycle.
"""
