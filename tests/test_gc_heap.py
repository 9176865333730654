import gc
import weakref

from widellm.gc_heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other = None


def test_freeze_collects_garbage_then_hides_survivors_from_collection():
    cycle_a, cycle_b = _Node(), _Node()
    cycle_a.other, cycle_b.other = cycle_b, cycle_a
    garbage = weakref.ref(cycle_a)
    del cycle_a, cycle_b  # only a reference cycle keeps them: the collector's job
    survivors = [[i] for i in range(1000)]
    try:
        frozen = freeze_startup_heap("test")
        assert garbage() is None  # collected before the freeze, not frozen with the rest
        # Frozen objects can still be freed by reference counting (the logging call after the
        # freeze drops a few), so the count read now may be a little lower than the returned.
        assert frozen >= gc.get_freeze_count() >= len(survivors)
        # Frozen objects are in no generation, so no later collection walks them.
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(s) in tracked for s in survivors)
    finally:
        gc.unfreeze()
    assert id(survivors[0]) in {id(o) for o in gc.get_objects()}
