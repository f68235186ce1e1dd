"""The speculation layer, one concept per module; :mod:`sofx.speculate` is its public entry point.

``policy``      the adaptive policy (pause while clipping keeps firing)
``decisions``   pure decision logic: context, block readiness, early veto, validation plan
``apply``       carrying decisions out on one block's tensors with :class:`sofx.Adam`
``tree_step``   one speculative step over a whole params pytree, inline
"""
