"""A custom worker adapter (`adapter = "tests.torchrun.custom_adapter:factory"`) that records
the context it was installed with."""

import json
import os


class RecordingAdapter:
    def __init__(self, context):
        self.context = context

    def install(self, context):
        path = os.path.join(os.environ["TEST_ADAPTER_OUT"], f"installed-{context.local_rank}.json")
        with open(path, "w") as f:
            json.dump({"generation": context.generation, "slot": context.slot, "step": context.checkpoint_step,
                       "same": context is self.context}, f)


def factory(context):
    return RecordingAdapter(context)
