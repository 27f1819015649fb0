"""engine/heap.py: the start-up heap frozen out of later collections."""
import gc

from mimw.engine.heap import frozen_heap


def _tracked() -> set[int]:
    return {id(o) for g in range(3) for o in gc.get_objects(generation=g)}


def test_a_frozen_heap_keeps_live_objects_out_of_the_collected_generations_until_the_block_ends():
    keep = [[i] for i in range(1000)]  # container objects the collector tracks
    with frozen_heap() as frozen:
        assert frozen >= len(keep) and gc.get_freeze_count() >= len(keep)
        tracked = _tracked()
        assert not any(id(o) in tracked for o in keep)
    assert gc.get_freeze_count() == 0
    tracked = _tracked()
    assert all(id(o) in tracked for o in keep)
