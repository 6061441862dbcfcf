"""The core both Bagua strategies share, by concern; each strategy module holds only its framework's hooks.

- :mod:`.strategy`: ``BaguaStrategyCore``, the mixin with the constructor, wrapping, joining and failing;
- :mod:`.arguments`: argument checks and the reduction;
- :mod:`.checkpoint`: the versioned ``"bagua"`` checkpoint entry;
- :mod:`.faults`: store probing, restarts, failure diagnosis.
"""
