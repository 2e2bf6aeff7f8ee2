"""lab/sglang_assets.py: the lock parses, the kernel trim drops exactly its table's paths (and fails loudly
when one is gone), and packed bundles install on the host side only after every file arrives sha256-intact."""

from __future__ import annotations

import hashlib
import os
import tarfile
import zipfile

import pytest

from lab import sglang_assets as sa

KERNEL_MEMBERS = {
    "sgl_kernel/__init__.py": b"from sgl_kernel.version import __version__\n",
    "sgl_kernel/version.py": b'__version__ = "0.4.5"\n',
    "sgl_kernel/flash_ops.abi3.so": b"FA3" * 1000,
    "sgl_kernel/sm100/x.so": b"blackwell",
    "sgl_kernel/sm90/common_ops.abi3.so": b"hopper",
    "sgl_kernel/infllm_ops.so": b"infllm",
    "sglang_kernel-0.4.5.dist-info/METADATA": b"Name: sglang-kernel\nVersion: 0.4.5\n",
    "sglang_kernel-0.4.5.dist-info/RECORD": b"",
}
TRIMMED_AWAY = {"sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/x.so"}


def _zip(path, members):
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _pin(path, name, version):
    data = path.read_bytes()
    return sa.Pin(name, version, hashlib.sha256(data).hexdigest(), len(data), path.name)


def _lock_line(pin):
    return f"{pin.requirement} {pin.sha256} {pin.size} {pin.filename}"


@pytest.fixture
def downloaded(tmp_path):
    """A download folder: three fake wheels (one of incompressible bytes spanning bundles), the kernel wheel and
    its trimmed tarball; returns (pins, folder)."""
    dest = tmp_path / "dl"
    dest.mkdir()
    pins = [
        _pin(_zip(dest / "alpha-1.0-py3-none-any.whl", {"alpha/__init__.py": b"A = 1\n"}), "alpha", "1.0"),
        _pin(_zip(dest / "beta_pkg-2.0-py3-none-any.whl", {"beta_pkg/__init__.py": b""}), "beta-pkg", "2.0"),
    ]
    big = dest / "gamma-3.0-py3-none-any.whl"
    big.write_bytes(os.urandom(300_000))
    pins.append(_pin(big, "gamma", "3.0"))
    kernel = _zip(dest / "sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl", KERNEL_MEMBERS)
    pins.append(_pin(kernel, sa.KERNEL, "0.4.5"))
    sa.trim(kernel, dest / sa.TRIMMED)
    return pins, dest


def test_trim_drops_exactly_the_trimmed_paths_and_keeps_the_rest(tmp_path):
    """The trimmed tarball holds every wheel member except flash_ops and sm100/, byte for byte."""
    wheel = _zip(tmp_path / "k.whl", KERNEL_MEMBERS)
    dropped = sa.trim(wheel, tmp_path / "t.tar.xz")
    assert set(dropped) == TRIMMED_AWAY
    with tarfile.open(tmp_path / "t.tar.xz", "r:xz") as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert got == {k: v for k, v in KERNEL_MEMBERS.items() if k not in TRIMMED_AWAY}
    assert not (tmp_path / "t.tar.xz.tmp").exists()


def test_trim_is_deterministic(tmp_path):
    """Trimming the same wheel twice gives the same bytes (same sha256 whatever the machine's time zone)."""
    wheel = _zip(tmp_path / "k.whl", KERNEL_MEMBERS)
    sa.trim(wheel, tmp_path / "a.tar.xz")
    sa.trim(wheel, tmp_path / "b.tar.xz")
    assert (tmp_path / "a.tar.xz").read_bytes() == (tmp_path / "b.tar.xz").read_bytes()


def test_a_trim_whose_path_is_absent_fails_naming_it(tmp_path):
    """A kernel without sgl_kernel/sm100/ is refused with an error naming that path, and no tarball is written."""
    members = {k: v for k, v in KERNEL_MEMBERS.items() if not k.startswith("sgl_kernel/sm100/")}
    with pytest.raises(ValueError, match="sgl_kernel/sm100/"):
        sa.trim(_zip(tmp_path / "k.whl", members), tmp_path / "t.tar.xz")
    assert not (tmp_path / "t.tar.xz").exists()


def test_a_trim_may_not_drop_init_or_infllm_ops():
    """A trim table that would drop sgl_kernel/__init__.py or an infllm_ops file is refused."""
    names = sorted(KERNEL_MEMBERS)
    with pytest.raises(ValueError, match="__init__"):
        sa.trimmed_members(names, [sa.Trim("sgl_kernel/", "everything")])
    with pytest.raises(ValueError, match="infllm_ops"):
        sa.trimmed_members(names, [sa.Trim("sgl_kernel/infllm_ops.so", "wrong")])


def test_the_trim_table_gives_a_reason_for_each_path():
    """Every entry of TRIMS names a path and a reason, and FA3 and sm100 are among them."""
    assert {t.path for t in sa.TRIMS} == {"sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/"}
    assert all(len(t.reason) > 20 for t in sa.TRIMS)


def test_lock_parsing_reads_pins_and_refuses_malformed_lines():
    """Comments and blank lines are skipped; a pin has name, version, sha256, size, filename; a bad line is an
    error naming its number."""
    sha = "ab" * 32
    pins = sa.parse_lock(f"# header\n\nfoo-bar==1.2.post3 {sha} 123 foo_bar-1.2.post3-py3-none-any.whl  # c\n")
    assert pins == [sa.Pin("foo-bar", "1.2.post3", sha, 123, "foo_bar-1.2.post3-py3-none-any.whl")]
    assert pins[0].requirement == "foo-bar==1.2.post3"
    for bad in (
        f"foo {sha} 1 f.whl",
        f"foo==1 {sha[:-1]} 1 f.whl",
        f"foo==1 {sha} x f.whl",
        f"foo==1 {'zz' * 32} 1 f.whl",
        f"foo==1 {sha} 1",
    ):
        with pytest.raises(ValueError, match="lock line 2"):
            sa.parse_lock(f"# h\n{bad}\n")


def test_the_repository_lock_pins_95_files_with_the_kernel():
    """The committed lock parses: 95 distinct files, sglang 0.5.16 and sglang-kernel 0.4.5 among them."""
    pins = sa.read_lock(sa.DEFAULT_LOCK)
    assert len(pins) == 95
    assert sa.kernel_pin(pins).version == "0.4.5"
    assert any(p.requirement == "sglang==0.5.16" for p in pins)


def test_download_fetches_only_what_is_missing_and_verifies_every_sha256(downloaded, monkeypatch):
    """Files already present with the right sha256 are not fetched again; a fetched file with other bytes is an
    error naming it."""
    pins, dest = downloaded
    good = (dest / pins[0].filename).read_bytes()
    (dest / pins[0].filename).unlink()
    calls = []

    def fake_pip(requirements, folder):
        calls.append(list(requirements))
        (folder / pins[0].filename).write_bytes(good)

    monkeypatch.setattr(sa, "pip_download", fake_pip)
    sa.download(pins, dest)
    assert calls == [["alpha==1.0"]]
    (dest / pins[1].filename).unlink()
    monkeypatch.setattr(
        sa, "pip_download", lambda reqs, folder: (folder / pins[1].filename).write_bytes(b"x" * pins[1].size)
    )
    with pytest.raises(ValueError, match=pins[1].filename):
        sa.download(pins, dest)


def test_pack_then_install_round_trip(downloaded, tmp_path, monkeypatch):
    """Bundles stay under the limit; install assembles and sha256-checks every file, installs only when the last
    bundle arrives (wheels to pip, kernel untarred), and running the last bundle again does nothing new."""
    pins, dest = downloaded
    limit = sa.MANIFEST_ROOM + 150_000
    bundles = sa.pack(pins, dest, tmp_path / "carry", limit)
    assert len(bundles) >= 3 and all(sa.folder_size(b) <= limit for b in bundles)
    calls = []
    monkeypatch.setattr(sa.bundles, "pip_install", lambda wheels, site: calls.append(sorted(w.name for w in wheels)))
    stage, site = tmp_path / "stage", tmp_path / "site"
    for bundle in bundles[:-1]:
        missing, installed = sa.install(bundle, stage, site)
        assert missing and not installed and not calls
    assert sa.install(bundles[-1], stage, site) == ([], True)
    assert calls == [sorted(p.filename for p in pins if p.name != sa.KERNEL)]
    for pin in pins:
        if pin.name != sa.KERNEL:
            assert (stage / (sa.PREFIX + pin.filename)).read_bytes() == (dest / pin.filename).read_bytes()
    assert (site / "sgl_kernel" / "infllm_ops.so").read_bytes() == b"infllm"
    assert not (site / "sgl_kernel" / "flash_ops.abi3.so").exists()
    assert sa.install(bundles[-1], stage, site) == ([], False)
    assert len(calls) == 1
    assert sa.run_install(bundles[-1], stage, site, check=False) == 0


def test_a_corrupted_chunk_is_refused(downloaded, tmp_path, monkeypatch):
    """A chunk with a flipped byte makes install fail naming the damaged file, and nothing is installed."""
    pins, dest = downloaded
    bundles = sa.pack(pins, dest, tmp_path / "carry", sa.MANIFEST_ROOM + 150_000)
    chunk = next(p for p in sorted(bundles[0].iterdir()) if p.name != "assets.json" and p.stat().st_size > 1000)
    data = bytearray(chunk.read_bytes())
    data[500] ^= 0xFF
    chunk.write_bytes(bytes(data))
    monkeypatch.setattr(
        sa.bundles, "pip_install", lambda wheels, site: pytest.fail("installed despite a damaged chunk")
    )
    with pytest.raises(ValueError, match=r"sha256"):
        for bundle in bundles:
            sa.install(bundle, tmp_path / "stage", tmp_path / "site")


def test_pack_refuses_a_file_that_does_not_match_the_lock(downloaded, tmp_path):
    """A wheel whose bytes changed after download is not packed; the error names it."""
    pins, dest = downloaded
    (dest / pins[0].filename).write_bytes(b"other")
    with pytest.raises(ValueError, match=pins[0].filename):
        sa.pack(pins, dest, tmp_path / "carry", 1 << 20)
