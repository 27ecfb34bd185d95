"""The user's side: flattening model/optimizer/extra state into named tensors and objects, TensorShard,
RNG state.
"""
