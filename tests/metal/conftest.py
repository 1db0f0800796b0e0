import pytest

pytest.importorskip("mlx.core")
