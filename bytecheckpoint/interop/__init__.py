"""Interoperability with PyTorch's own formats: DCP directories and ``torch.save`` files.

Everything here reads pickles written by other tools, so nothing here ever runs the standard
unpickler: :mod:`.safe_pickle` admits a fixed list of classes and builds inert stand-ins.
"""
