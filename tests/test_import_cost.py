"""What importing sofx costs: not ``torch._dynamo`` (with sympy and triton about 1.5 s of a core, where ``import
torch`` is about 1.2 s), which ``import torch`` does not import either.

Each check runs in a fresh Python process: the test process has long imported dynamo. The offload process
executor's worker (``python -m sofx.offload.process_worker``) is one such process, started by every optimizer
that runs on it. Dynamo is imported where something is compiled, or where a method that runs eagerly under
``torch.compile`` is first called (as ``torch.optim``'s ``zero_grad`` imports it).
"""

from __future__ import annotations

import pytest

from helpers import script_prints_ok

_NO_DYNAMO = """
import sys
{imports}
assert "torch._dynamo" not in sys.modules, "torch._dynamo was imported"
print("ok")
"""


@pytest.mark.parametrize("imports", [
    "import sofx",
    "import sofx.offload.process_worker",
    "import sofx.offload; sofx.offload.SpeculativeAdamW, sofx.offload.OffloadEngine",
    "from sofx.offload import SpeculativeAdam, SpeculativeAdamW",
])
def test_importing_sofx_does_not_import_dynamo(imports: str) -> None:
    script_prints_ok(_NO_DYNAMO.format(imports=imports), timeout=120)
