"""What only the Fabric strategy (``strategies/fabric.py``) needs, by concern.

- :mod:`.checkpoint`: ``fabric.save``'s and ``fabric.load``'s Bagua entries, with filters and resizing;
- :mod:`.engines`: the wrapped models a Fabric run has set up, and their optimizers;
- :mod:`.autotune`: bucket autotuning for models Fabric sets up.
"""
