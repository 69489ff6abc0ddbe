"""``python -m hixl_connector check``: does this machine's fabric carry the connector's reads?

It brings up a prefill and a decode back-end the way the connector does (the same
registrations, placements and options, ``connector.kv.registered_kv``), links them, runs
guarded reads of probe blocks (lease word, blocks, lease word again), verifies every byte and
the guard's verdict, and prints the fabric the link used, where each registration lives, the
bandwidth, and for any failure what to change. Part of the runtime install: no tools needed.
"""
