"""Peers: the side channel to each prefill rank (envelope, sockets), the handshake, the
registry of links, and each rank's addresses.
"""
