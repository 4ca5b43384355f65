"""The default sparse geometry: tokens per query tile and per KV block.

The bottom of the stack, so that every layer (the kernels, the DSV selection, context parallelism and its
planner) takes its defaults from one place. A model's own geometry comes from its token layout (one 3D
tile per query tile; `dsv.kv_block` or the tile per KV block: `dsv_jax.dsv.plan`); these are the
defaults of the functions that take the geometry as arguments.
"""

Q_TILE = 64  # query rows that share one KV list
KV_BLOCK = 64  # keys per selectable KV block
