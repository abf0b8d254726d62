"""How a rank holds the weights: layer-sharded stores, vocabulary-parallel head, tensor-
parallel slices (--tp) and the matrices' slices.
"""
