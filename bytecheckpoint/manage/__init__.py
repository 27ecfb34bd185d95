"""Checkpoints of a root as a catalog: listing, protection rules and retention policies shared by bcp
ls/gc, the manager and tiering.
"""
