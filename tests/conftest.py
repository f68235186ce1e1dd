import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("sofx", deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("SOFX_HYPOTHESIS_PROFILE", "sofx"))

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture
def rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
