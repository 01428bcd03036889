"""``hf:`` and URL downloads against a local stand-in for the Hugging Face Hub
(``tests/hub_standin.py``, reached as ``HF_ENDPOINT`` would name it): a download cut halfway
resumes from where it stopped, a file whose sha256 is not the one the server states is refused
and deleted, a repository of one GGUF needs no file name, and a host with no route to the
server is told so."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.models.hub import DownloadError, download, parse_hf
from tests.hub_standin import HubStandIn, hub_standin

SIZE = 3 * 1024 * 1024 + 4321
REPO = "test-org/tiny-model-GGUF"
FILE = "tiny-model.Q8_0.gguf"


@pytest.fixture
def hub() -> Iterator[HubStandIn]:
    with hub_standin() as standin:
        standin.repos[REPO] = {FILE: os.urandom(SIZE), "README.md": b"# tiny\n"}
        yield standin


def gets(hub: HubStandIn) -> list[tuple[str | None, int]]:
    """The GETs of the model file the stand-in answered: (Range asked, bytes sent)."""
    return [(r.range, r.sent) for r in hub.requests if r.method == "GET" and FILE in r.path]


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_hf_sources_parse() -> None:
    assert parse_hf("hf:org/repo").file is None
    assert parse_hf("hf:org/repo/sub/f.gguf").file == "sub/f.gguf"
    assert parse_hf("hf:org/repo@v2/f.gguf").revision == "v2"
    with pytest.raises(DownloadError, match="is not hf:ORG/REPO"):
        parse_hf("hf:justone")


def test_an_hf_download_cut_halfway_resumes_where_it_stopped(
    hub: HubStandIn, tmp_path: Path
) -> None:
    # huggingface_hub writes what it receives in pieces of 10 MiB and resumes after the last
    # whole one: a file of 3 such pieces, cut in the second, resumes after the first.
    size = 24 * 1024 * 1024 + 321
    hub.repos[REPO][FILE] = os.urandom(size)
    hub.cut_at = 16 * 1024 * 1024
    steps: list[tuple[int, int]] = []
    path = download(f"hf:{REPO}/{FILE}", lambda d, t: steps.append((d, t)), tmp_path, hub.url)
    assert path.read_bytes() == hub.repos[REPO][FILE]
    (first_range, first_sent), (resumed_range, resumed_sent) = gets(hub)
    assert first_range is None and first_sent == 16 * 1024 * 1024
    assert resumed_range is not None
    start = int(resumed_range.removeprefix("bytes=").removesuffix("-"))
    assert 0 < start <= first_sent and resumed_sent == size - start
    assert steps and steps[-1] == (size, size)


def test_a_repository_of_one_gguf_needs_no_file_name(hub: HubStandIn, tmp_path: Path) -> None:
    path = download(f"hf:{REPO}", None, tmp_path, hub.url)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hub.sha256(REPO, FILE)
    hub.repos[REPO]["other.Q4_0.gguf"] = b"GGUF"
    with pytest.raises(DownloadError, match="several GGUF files; name one"):
        download(f"hf:{REPO}", None, tmp_path, hub.url)


def test_an_hf_file_whose_checksum_is_wrong_is_refused_and_deleted(
    hub: HubStandIn, tmp_path: Path
) -> None:
    hub.stated_sha256[FILE] = "ab" * 32
    with pytest.raises(DownloadError, match="refused and deleted"):
        download(f"hf:{REPO}/{FILE}", None, tmp_path, hub.url)
    assert not [p for p in (tmp_path / "hub").rglob("*") if p.is_file() and p.stat().st_size > 1000]


def test_a_url_download_resumes_and_checks_the_stated_sha256(
    hub: HubStandIn, tmp_path: Path
) -> None:
    url = f"{hub.url}/{REPO}/resolve/main/{FILE}"
    hub.cut_at = SIZE // 3
    path = download(url, None, tmp_path)
    assert path.read_bytes() == hub.repos[REPO][FILE]
    assert [r for r, _ in gets(hub)] == [None, f"bytes={SIZE // 3}-"]
    wrong = f"{url}#sha256={'cd' * 32}"  # the URL's own checksum, which this file is not
    with pytest.raises(DownloadError, match="refused and deleted"):
        download(wrong, None, tmp_path / "again")
    assert not list((tmp_path / "again").rglob(FILE + "*"))


def test_a_host_with_no_route_to_the_hub_is_told_so(tmp_path: Path) -> None:
    nowhere = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(DownloadError, match=r"this host has no route to 127\.0\.0\.1"):
        download(f"hf:{REPO}/{FILE}", None, tmp_path, nowhere)
    with pytest.raises(DownloadError, match="no route"):
        download(f"{nowhere}/model.gguf", None, tmp_path)


def test_a_repository_of_a_hugging_face_model_downloads_its_folder(
    hub: HubStandIn, tmp_path: Path
) -> None:
    """``hf:ORG/REPO`` with no GGUF but a model's config and safetensors: the folder vLLM
    serves (config, weights, tokenizer), each file checked; no other weight format, no code,
    no subfolder, no readme."""
    repo = "test-org/tiny-hf"
    hub.repos[repo] = {
        "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
        "model.safetensors": os.urandom(200_000),
        "tokenizer.json": b"{}",
        "README.md": b"# tiny\n",
        "pytorch_model.bin": os.urandom(1000),
        "modeling_tiny.py": b"print('remote code')\n",
        "onnx/model.onnx": os.urandom(1000),
    }
    folder = download(f"hf:{repo}", None, tmp_path, hub.url)
    assert folder.is_dir()
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json"
    ]  # fmt: skip
    for path in folder.iterdir():
        assert path.read_bytes() == hub.repos[repo][path.name]
    hub.stated_sha256["model.safetensors"] = "ab" * 32  # a file whose checksum is wrong
    with pytest.raises(DownloadError, match="refused and deleted"):
        download(f"hf:{repo}@v2", None, tmp_path / "again", hub.url)
    hub.repos["test-org/docs-only"] = {"README.md": b"# nothing\n"}
    with pytest.raises(DownloadError, match=r"no \.gguf file and no Hugging Face model"):
        download("hf:test-org/docs-only", None, tmp_path, hub.url)


def test_a_model_folder_from_the_hub_reads_as_a_card_vllm_serves(
    hub: HubStandIn, tmp_path: Path
) -> None:
    """A folder ``transformers`` wrote (the kind ``tessera models add DIR`` takes), published
    as a repository: ``hf:ORG/REPO`` gives a folder that reads as the same model's card."""
    from libs.models.hf_info import read_folder_card
    from tests.made_models import make_hf_folder

    made = make_hf_folder(tmp_path / "made")
    hub.repos["test-org/tiny-llama"] = {p.name: p.read_bytes() for p in made.iterdir()}
    folder = download("hf:test-org/tiny-llama", None, tmp_path / "cache", hub.url)
    card = read_folder_card(folder, name="tiny", source="hf:test-org/tiny-llama")
    alone = read_folder_card(made, name="tiny", source=str(made))
    assert (card.format, card.architecture, card.layers) == ("hf", "LlamaForCausalLM", 2)
    assert card.sha256 == alone.sha256  # the same model, file for file
