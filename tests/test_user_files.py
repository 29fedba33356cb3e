"""Files written for the user get ordinary permissions (the umask's, not tempfile's 0600 / 0700) and are written
under unique temporary names."""

import os
import stat

import pytest

from portrl.user_files import ordinary_permissions, temp_name, umask


@pytest.fixture
def mask_027():
    old = os.umask(0o027)
    yield 0o027
    os.umask(old)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_temp_names_are_unique_hidden_and_keep_a_suffix(tmp_path):
    a, b = temp_name(tmp_path / "plot.png", suffix=".png"), temp_name(tmp_path / "plot.png", suffix=".png")
    assert a != b and a.parent == tmp_path and a.name.startswith(".plot.png.tmp-") and a.suffix == ".png"


def test_ordinary_permissions_follow_the_umask(tmp_path, mask_027):
    import tempfile

    assert umask() == 0o027
    fd, f = tempfile.mkstemp(dir=tmp_path)
    os.close(fd)
    d = tempfile.mkdtemp(dir=tmp_path)
    assert (_mode(f), _mode(d)) == (0o600, 0o700)
    ordinary_permissions(f)
    ordinary_permissions(d)
    assert (_mode(f), _mode(d)) == (0o640, 0o750)


def test_user_outputs_are_readable_by_the_group(tmp_path, mask_027):
    from portrl.config.composition import save_yaml
    from portrl.config.options_schema import default_config
    from portrl.data.preprocess import write_split
    from portrl.models import write_tiny_model

    save_yaml(default_config(), tmp_path / "config.yaml")
    assert _mode(tmp_path / "config.yaml") == 0o640
    write_split([{"a": 1}], tmp_path / "data" / "train.parquet")
    assert _mode(tmp_path / "data" / "train.parquet") == 0o640
    model = write_tiny_model(tmp_path / "tiny", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=32)
    assert _mode(model) == 0o750 and _mode(model / "config.json") == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "data", "tiny"]  # no temporaries left
