"""ProgressBeacon.enter(on_training_thread=True): an op entered from a hook thread (DDP's bucket
hooks run on autograd device threads on GPUs) is the training thread's current op."""

import threading

from lm_resiliency.scout.monitor import ProgressBeacon


def _from_thread(fn):
    worker = threading.Thread(target=fn)
    worker.start()
    worker.join(10)
    assert not worker.is_alive()


def test_op_entered_from_another_thread_is_the_training_threads_current_op():
    beacon = ProgressBeacon()
    beacon.progress(1)  # this thread is the training thread
    _from_thread(lambda: beacon.enter("comm:ddp_grad_bucket", on_training_thread=True))
    snap = beacon.snapshot()
    assert snap["op"] == "comm:ddp_grad_bucket"
    assert [a["thread"] for a in snap["active"]] == [threading.get_ident()]
    _from_thread(lambda: beacon.exit("comm:ddp_grad_bucket"))  # completion callback thread
    snap = beacon.snapshot()
    assert snap["op"] is None and snap["collectives"] == 1 and snap["active"] == []


def test_without_the_flag_the_op_stays_on_the_calling_thread():
    beacon = ProgressBeacon()
    beacon.progress(1)
    _from_thread(lambda: beacon.enter("comm:ddp_grad_bucket"))
    assert beacon.snapshot()["op"] is None  # the training thread itself is outside any op
