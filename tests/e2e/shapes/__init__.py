"""Deployment shapes beyond one P and one D of equal TP, sharing one set of servers."""
