"""The distribution as users get it: an installed wheel, the entry point, and an import-light package."""

import json
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, **kw)


def test_import_is_light():
    """`import vllm_moe_w8` (what every vLLM process does for the entry point) pulls in neither vLLM nor torch."""
    r = run_python("import sys, vllm_moe_w8; print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_entry_point_is_declared():
    eps = [ep for ep in metadata.entry_points(group="vllm.general_plugins") if ep.name == "neuron_w8"]
    assert len(eps) == 1 and eps[0].value == "vllm_moe_w8:register"
    scripts = [ep for ep in metadata.entry_points(group="console_scripts") if ep.name == "vllm-moe-w8"]
    assert scripts and scripts[0].value == "vllm_moe_w8.tools.cli:main"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("vllm_moe_w8-*.whl")
    return whl


def test_wheel_ships_kernels_and_configs(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, pkg in (("kernels", "vllm_moe_w8/kernels"), ("configs", "vllm_moe_w8/configs")):
        sources = [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in (".py", ".json") and "__pycache__" not in p.parts]
        assert sources, f"{folder}/ is empty"
        for p in sources:
            assert f"{pkg}/{p.relative_to(ROOT / folder).as_posix()}" in names, f"{p} is not in the wheel"
    assert not any(n.startswith(("kernels/", "configs/", "tests/")) for n in names), "top-level folders must not leak"


def test_wheel_ships_every_sub_package_and_the_native_kernel_source(wheel):
    """Every module of every sub-package (a room missing from pyproject's `packages` would be absent) and every native
    kernel source and header in csrc/ (a header missing from package-data breaks the build at first use)."""
    names = set(zipfile.ZipFile(wheel).namelist())
    package = ROOT / "vllm_moe_w8"
    sources = [p for p in package.rglob("*") if p.is_file() and p.suffix in (".py", ".cpp", ".h") and "__pycache__" not in p.parts]
    assert any(p.suffix == ".cpp" for p in sources), "the native kernel source is missing from the tree"
    assert any(p.suffix == ".h" for p in sources), "the native kernel header is missing from the tree"
    for p in sources:
        assert f"vllm_moe_w8/{p.relative_to(package).as_posix()}" in names, f"{p} is not in the wheel"


def test_installed_wheel_imports_from_its_own_files(wheel, tmp_path):
    """Install the wheel into a scratch target and import kernels/configs from there, not from the source tree."""
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    code = (
        "import json, importlib.resources as res, vllm_moe_w8, vllm_moe_w8.kernels, vllm_moe_w8.configs, vllm_moe_w8.codec.fp8\n"
        "cfgs = [p.name for p in res.files('vllm_moe_w8.configs').iterdir() if p.name.endswith('.json')]\n"
        "print(json.dumps({'pkg': vllm_moe_w8.__file__, 'kernels': vllm_moe_w8.kernels.__file__, 'configs': cfgs}))"
    )
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    r = run_python(code, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["pkg"].startswith(str(target)) and info["kernels"].startswith(str(target))
    assert sorted(info["configs"]) == sorted(p.name for p in (ROOT / "configs").glob("*.json"))
