"""The on-disk format: boxes, dtypes, checksums, the object codec, metadata and its checks. No I/O
beyond reading a file's header.
"""
