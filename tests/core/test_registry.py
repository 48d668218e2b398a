"""Plugin discovery through real `flashrec.models` entry points, and config.json reading.

Fake plugins are real distributions: `<name>-<ver>.dist-info/` folders (METADATA and
entry_points.txt) next to a plugin module in tmp_path. importlib.metadata reads sys.path, so
discovery runs in a subprocess with PYTHONPATH=tmp_path prepended and prints JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest

from flashrec_core.registry import Registry, RegistryError, load_hf_config, read_architecture

QWEN3_CAPS = ["rms_norm_fp8", "silu_mul_fp8", "qk_norm_rope_kv"]
PLUGIN_KEYS = {
    "name",
    "distribution",
    "version",
    "architectures",
    "capabilities",
    "contract",
    "status",
    "error",
}

GOOD_PLUGIN = """
from flashrec_core.fused import RMS_NORM_FP8, SILU_MUL_FP8
from flashrec_core.spec import BaseModelSpec, WeightMap

spec = BaseModelSpec(
    name="fakegood", architectures=("FakeGoodForCausalLM",), config_parser=dict,
    weight_map=WeightMap(), model_class="fake_good:Nope", hf_config_class="x:Y",
    capabilities=(RMS_NORM_FP8, SILU_MUL_FP8),
)
"""
DUP_PLUGIN = """
from flashrec_core.spec import BaseModelSpec, WeightMap

spec = BaseModelSpec(
    name="{name}", architectures=("DupForCausalLM",), config_parser=dict,
    weight_map=WeightMap(), model_class="x:Y", hf_config_class="x:Y",
)
"""
BROKEN_PLUGIN = """
import flashrec_fake_missing_dependency_xyz  # ModuleNotFoundError at import
"""
NOT_A_SPEC_PLUGIN = """
spec = {"name": "notaspec"}  # a dict, not a ModelSpec
"""
V1_PLUGIN = """
from flashrec_core.spec import BaseModelSpec, WeightMap

# written against contract v1 (and its then-required hf_config_class): loads unchanged
spec = BaseModelSpec(
    name="vone", architectures=("VOneForCausalLM",), config_parser=dict,
    weight_map=WeightMap(), model_class="x:Y", hf_config_class="x:Y", contract_version=1,
)
"""
OLD_CONTRACT_PLUGIN = """
from flashrec_core.spec import BaseModelSpec, WeightMap

spec = BaseModelSpec(
    name="oldcontract", architectures=("OldForCausalLM",), config_parser=dict,
    weight_map=WeightMap(), model_class="x:Y", hf_config_class="x:Y", contract_version=999,
)
"""

DISCOVER_SCRIPT = """
import json, sys
from flashrec_core.registry import Registry

reg = Registry.discover()
out = {"plugins": [p.as_dict() for p in reg.plugins], "resolve": {}}
for arch in sys.argv[1:]:
    try:
        out["resolve"][arch] = {"ok": True, "name": reg.resolve(arch).name}
    except Exception as exc:
        cause = exc.__cause__
        out["resolve"][arch] = {
            "ok": False, "type": type(exc).__name__, "msg": str(exc),
            "cause_type": None if cause is None else type(cause).__name__,
            "cause_msg": None if cause is None else str(cause),
        }
print(json.dumps(out))
"""

ARCHS = [
    "Qwen3ForCausalLM", "FakeGoodForCausalLM", "DupForCausalLM", "BrokenForCausalLM",
    "NotASpecForCausalLM", "OldForCausalLM", "MisnamedForCausalLM", "NobodyForCausalLM",
    "VOneForCausalLM",
]  # fmt: skip


def _fake_dist(
    root: Path, dist: str, ver: str, entry_points: dict[str, str], module: str, src: str
):
    info = root / f"{dist.replace('-', '_')}-{ver}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {ver}\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[flashrec.models]\n{lines}")
    (root / f"{module}.py").write_text(textwrap.dedent(src))


def _plugin_env(root: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


FAKE_DISTS = [  # (distribution, version, architecture, plugin module, module source)
    ("flashrec-models-fakegood", "1.2.3", "FakeGoodForCausalLM", "fake_good", GOOD_PLUGIN),
    ("flashrec-models-dupa", "0.0.1", "DupForCausalLM", "fake_dup_a", DUP_PLUGIN.format(name="a")),
    ("flashrec-models-dupb", "0.0.1", "DupForCausalLM", "fake_dup_b", DUP_PLUGIN.format(name="b")),
    ("flashrec-models-broken", "0.3.0", "BrokenForCausalLM", "fake_broken", BROKEN_PLUGIN),
    ("flashrec-models-notaspec", "0.1.0", "NotASpecForCausalLM", "fake_nospec", NOT_A_SPEC_PLUGIN),
    ("flashrec-models-oldcontract", "0.1.0", "OldForCausalLM", "fake_old", OLD_CONTRACT_PLUGIN),
    ("flashrec-models-vone", "0.1.0", "VOneForCausalLM", "fake_vone", V1_PLUGIN),
    # entry point named MisnamedForCausalLM, but the spec serves FakeGoodForCausalLM
    ("flashrec-models-misnamed", "0.1.0", "MisnamedForCausalLM", "fake_misnamed", GOOD_PLUGIN),
]  # fmt: skip


@pytest.fixture(scope="module")
def fake_plugins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plugins")
    for dist, ver, arch, module, src in FAKE_DISTS:
        _fake_dist(root, dist, ver, {arch: f"{module}:spec"}, module, src)
    return root


@pytest.fixture(scope="module")
def discovered(fake_plugins: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", DISCOVER_SCRIPT, *ARCHS],
        env=_plugin_env(fake_plugins), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    out["by_dist"] = {p["distribution"]: p for p in out["plugins"]}
    return out


def test_discover_finds_qwen3_plugin_in_process() -> None:
    reg = Registry.discover()
    [qwen] = [p for p in reg.plugins if "Qwen3ForCausalLM" in p.architectures]
    assert qwen.distribution == "flashrec-models-qwen3"
    assert qwen.version == version("flashrec-models-qwen3")
    assert qwen.status == "ok" and qwen.error is None
    assert qwen.as_dict()["capabilities"] == QWEN3_CAPS
    assert reg.resolve("Qwen3ForCausalLM").architectures == ("Qwen3ForCausalLM",)


def test_unknown_architecture_lists_installed_and_suggests_package() -> None:
    with pytest.raises(RegistryError) as info:
        Registry.discover().resolve("FooBarForCausalLM")
    msg = str(info.value)
    assert "'FooBarForCausalLM'" in msg
    assert "Installed: " in msg and "Qwen3ForCausalLM" in msg
    assert "pip install flashrec-models-foobar" in msg


def test_fake_plugin_discovered_with_metadata(discovered: dict) -> None:
    good = discovered["by_dist"]["flashrec-models-fakegood"]
    assert good == {
        "name": "fakegood", "distribution": "flashrec-models-fakegood", "version": "1.2.3",
        "architectures": ["FakeGoodForCausalLM"], "capabilities": ["rms_norm_fp8", "silu_mul_fp8"],
        "contract": 2, "status": "ok", "error": None,
    }  # fmt: skip
    assert discovered["resolve"]["FakeGoodForCausalLM"] == {"ok": True, "name": "fakegood"}
    qwen = discovered["by_dist"]["flashrec-models-qwen3"]
    assert qwen["status"] == "ok" and qwen["capabilities"] == QWEN3_CAPS


def test_unknown_architecture_lists_every_installed_arch(discovered: dict) -> None:
    res = discovered["resolve"]["NobodyForCausalLM"]
    assert res["ok"] is False and res["type"] == "RegistryError"
    for arch in ("Qwen3ForCausalLM", "FakeGoodForCausalLM", "DupForCausalLM", "BrokenForCausalLM"):
        assert arch in res["msg"]
    assert "pip install flashrec-models-nobody" in res["msg"]


def test_two_plugins_claiming_one_arch_is_an_error_naming_both(discovered: dict) -> None:
    res = discovered["resolve"]["DupForCausalLM"]
    assert res["ok"] is False and res["type"] == "RegistryError"
    assert "'DupForCausalLM'" in res["msg"]
    assert "flashrec-models-dupa" in res["msg"] and "flashrec-models-dupb" in res["msg"]


def test_broken_plugin_error_is_deferred_and_chained(discovered: dict) -> None:
    broken = discovered["by_dist"]["flashrec-models-broken"]
    assert broken["status"] == "error"
    assert broken["architectures"] == ["BrokenForCausalLM"]
    assert broken["error"].startswith("ModuleNotFoundError: ")
    assert "flashrec_fake_missing_dependency_xyz" in broken["error"]
    res = discovered["resolve"]["BrokenForCausalLM"]
    assert res["ok"] is False and res["type"] == "RegistryError"
    assert "flashrec-models-broken" in res["msg"] and "BrokenForCausalLM" in res["msg"]
    assert res["cause_type"] == "ModuleNotFoundError"
    assert "flashrec_fake_missing_dependency_xyz" in res["cause_msg"]
    # the broken plugin does not take the others down
    assert discovered["resolve"]["Qwen3ForCausalLM"] == {"ok": True, "name": "qwen3"}
    assert discovered["resolve"]["FakeGoodForCausalLM"]["ok"] is True


def test_plugin_exporting_non_spec_has_error_status(discovered: dict) -> None:
    bad = discovered["by_dist"]["flashrec-models-notaspec"]
    assert bad["status"] == "error" and bad["capabilities"] == []
    assert bad["error"].startswith("TypeError: ")
    assert "flashrec-models-notaspec" in bad["error"] and "ModelSpec" in bad["error"]
    res = discovered["resolve"]["NotASpecForCausalLM"]
    assert res["type"] == "RegistryError" and res["cause_type"] == "TypeError"


def test_plugin_with_wrong_contract_version_has_error_status(discovered: dict) -> None:
    old = discovered["by_dist"]["flashrec-models-oldcontract"]
    assert old["status"] == "error"
    assert "flashrec-models-oldcontract" in old["error"] and "v999" in old["error"]
    res = discovered["resolve"]["OldForCausalLM"]
    assert res["type"] == "RegistryError" and "v999" in res["cause_msg"]


def test_contract_v1_plugin_loads_and_says_so(discovered: dict) -> None:
    vone = discovered["by_dist"]["flashrec-models-vone"]
    assert vone["status"] == "ok" and vone["contract"] == 1
    assert discovered["resolve"]["VOneForCausalLM"] == {"ok": True, "name": "vone"}
    assert discovered["by_dist"]["flashrec-models-fakegood"]["contract"] == 2
    assert discovered["by_dist"]["flashrec-models-oldcontract"]["contract"] is None
    assert "loads v1, v2" in discovered["by_dist"]["flashrec-models-oldcontract"]["error"]


def test_read_architecture_override_wins(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert read_architecture(tmp_path, "OtherForCausalLM") == "OtherForCausalLM"
    assert read_architecture(tmp_path) == "Qwen3ForCausalLM"
    # the override does not even need a config.json
    assert read_architecture(tmp_path / "nowhere", "OtherForCausalLM") == "OtherForCausalLM"


@pytest.mark.parametrize("archs", [None, [], ["AForCausalLM", "BForCausalLM"]])
def test_read_architecture_missing_or_ambiguous(tmp_path: Path, archs: list[str] | None) -> None:
    config = {"model_type": "x"} if archs is None else {"architectures": archs}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RegistryError) as info:
        read_architecture(tmp_path)
    msg = str(info.value)
    assert str(tmp_path / "config.json") in msg
    assert "'architectures'" in msg and "--arch" in msg
    for name in archs or ():
        assert name in msg


def test_load_hf_config_missing_file_names_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_hf_config(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_load_hf_config_invalid_json_names_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ValueError) as info:
        load_hf_config(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)
    assert "not valid JSON" in str(info.value)


def test_load_hf_config_non_object_names_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError) as info:
        load_hf_config(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value) and "list" in str(info.value)


def test_cli_models_json(fake_plugins: Path) -> None:
    pytest.importorskip("flashrec_core.cli")
    script = (
        "import sys; from flashrec_core.cli import main; "
        "rc = main(['models', '--json']); "
        "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr); "
        "sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=_plugin_env(fake_plugins),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()  # other lines (a warning at exit) do not matter here
    assert "no torch" in lines, f"`flashrec models` must not import torch; stderr: {lines[-5:]}"
    rows = json.loads(proc.stdout)
    assert isinstance(rows, list)
    assert all(set(row) == PLUGIN_KEYS for row in rows), rows
    by_dist = {row["distribution"]: row for row in rows}
    qwen = by_dist["flashrec-models-qwen3"]
    assert qwen["architectures"] == ["Qwen3ForCausalLM"] and qwen["status"] == "ok"
    assert qwen["capabilities"] == QWEN3_CAPS and qwen["error"] is None
    broken = by_dist["flashrec-models-broken"]
    assert broken["status"] == "error" and "flashrec_fake_missing_dependency_xyz" in broken["error"]


def test_entry_point_name_must_match_spec_architectures(discovered: dict) -> None:
    bad = discovered["by_dist"]["flashrec-models-misnamed"]
    assert bad["status"] == "error" and bad["architectures"] == ["MisnamedForCausalLM"]
    assert "MisnamedForCausalLM" in bad["error"] and "FakeGoodForCausalLM" in bad["error"]
    # the well-formed plugin serving FakeGoodForCausalLM is unaffected
    assert discovered["resolve"]["FakeGoodForCausalLM"] == {"ok": True, "name": "fakegood"}
    assert discovered["resolve"]["MisnamedForCausalLM"]["type"] == "RegistryError"
