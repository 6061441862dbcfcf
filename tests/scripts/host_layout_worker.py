"""One rank of tests/test_multinode.py's host-layout test: wrap a model with bytegrad, take one step, report.

Launched with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT only, as by a plain env:// launcher; it prints one
JSON line: the engine's node layout, every rank's host, the collectives this rank ran and the warnings it logged.
"""

import json
import logging

import torch
import torch.distributed as dist
from torch import nn

from lightning_bagua.engine import BaguaDistributedDataParallel
from lightning_bagua.engine._torch_compat import destroy_process_group


def main() -> None:
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_bagua").addHandler(handler)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = BaguaDistributedDataParallel(nn.Linear(16, 4), algorithm="bytegrad")
    model(torch.randn(3, 16)).sum().backward()
    layout = model.communication_groups.layout
    result = {
        "layout": [layout.num_nodes, layout.ranks_per_node, layout.source],
        "hosts": list(layout.hosts),
        "ops": sorted(model.communication_counter.bytes_by_op),
        "warnings": warnings,
    }
    model.close()
    destroy_process_group(dist.GroupMember.WORLD)  # torch's own can deadlock on torch 2.2 to 2.7
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
