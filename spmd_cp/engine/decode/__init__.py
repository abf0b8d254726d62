"""The decode steps and their plan: one sequence's step (native, MLX's graph, split), the
batched steps, and the one decision that picks them.
"""
