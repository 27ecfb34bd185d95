"""A checkpoint's life on storage: the commit protocol, save locks, read leases, the latest pointer and
its timeline, resolve and verify.
"""
