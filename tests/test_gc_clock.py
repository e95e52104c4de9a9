import gc

from segki_lightning.rl.gc_clock import GcClock


def test_the_gc_clock_times_collections_only_while_started():
    """Collections between start and stop add their pauses (a full one counted); take() resets; none after stop."""
    clock = GcClock()
    clock.start()
    clock.start()                                   # once only
    try:
        for _ in range(1000):                       # garbage in cycles: a collection has work
            a = []
            a.append(a)
        gc.collect()
        seconds, full = clock.take()
        assert seconds > 0 and full >= 1
        assert clock.take() == (0.0, 0)
    finally:
        clock.stop()
    assert clock._on_collect not in gc.callbacks
    gc.collect()
    assert clock.take() == (0.0, 0)


def test_freeze_takes_the_live_objects_out_of_full_collections_until_stop():
    """With ``freeze`` every object alive at start leaves the collector's walks (gc.freeze) and returns at stop; a
    full collection then walks only newer objects, so it takes less time than one over the whole heap."""
    clock = GcClock()
    before = gc.get_freeze_count()
    keep = [[i] for i in range(200_000)]           # a large live heap, as a model and its libraries make
    clock.start(freeze=True)
    try:
        assert gc.get_freeze_count() >= before + len(keep)
        clock.take()                                # the collection before the freeze
        gc.collect()
        frozen_s, _ = clock.take()
    finally:
        clock.stop()
    assert gc.get_freeze_count() == before
    clock.start()
    try:
        gc.collect()
        whole_s, _ = clock.take()
    finally:
        clock.stop()
    assert frozen_s < whole_s / 2
    del keep
