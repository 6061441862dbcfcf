"""The import path ``low_rank`` uses for :class:`~lightning_bagua.engine.codec._segments.SegmentLayout`."""

from lightning_bagua.engine.codec._segments import SegmentBackend, SegmentLayout, segment_backend

__all__ = ["SegmentBackend", "SegmentLayout", "segment_backend"]
