"""Leases: P keeps a request's blocks for D under a lease (server), D tells P when it is done
or still waiting (client, messages), and the lease word guards every read (words).
"""
