"""Offline tools over whole checkpoints: export to safetensors/torch files and conversion to and from
PyTorch DCP.
"""
