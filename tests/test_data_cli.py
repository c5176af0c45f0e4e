"""Bad data sources stop `python -m jaxtrain.train` with one line naming the file and exit 2,
before the workdir is touched (run in this process, as tests/test_cli.py's bad-input cases)."""
import signal
import threading
import time

import gin
import numpy as np
import pytest

from jaxtrain.cli import train

pytestmark = [pytest.mark.slow]

TINY = ["--gin_param=LlamaConfig.embed=32", "--gin_param=LlamaConfig.layers=2", "--gin_param=LlamaConfig.mlp=64",
        "--gin_param=LlamaConfig.heads=4", "--gin_param=LlamaConfig.kv_heads=2", "--gin_param=MeshConfig.data=8",
        "--gin_param=TrainConfig.seq_len=32", "--gin_param=ObserveConfig.eval_batches=1"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    from store_helpers import make_chat_tokenizer, write_megatron_reference

    from jaxtrain.data.store.prepare import prepare

    root = tmp_path_factory.mktemp("corpora")
    text = root / "a.txt"
    text.write_text("\n\n".join(f"document number {i}" for i in range(50)), encoding="utf-8")
    prepare([str(text)], "bytes", root / "bytes_store", workers=1)
    tokenizer = make_chat_tokenizer(root / "bpe", ["document number 1 2 3"])
    prepare([str(text)], str(tokenizer), root / "bpe_store", workers=1)
    write_megatron_reference(root / "big_ids", [[[5, 6, 7000]]] * 40, np.uint16)
    write_megatron_reference(root / "empty", [], np.uint16)
    prepare([str(text)], "bytes", root / "truncated_store", workers=1)
    tokens = root / "truncated_store" / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-6])
    write_megatron_reference(root / "truncated_idx", [[[5, 6, 7]]] * 40, np.uint16)
    idx = root / "truncated_idx.idx"
    idx.write_bytes(idx.read_bytes()[:-5])
    return root


@pytest.mark.parametrize("bindings, names", [
    (["DataConfig.blend=(0.7, '{text}', 0, '{bytes_store}')"], ["{bytes_store}", "blend weight 0"]),
    (["DataConfig.blend=(0.7, '{text}', 0.3)"], ["must alternate weights and sources"]),
    (["DataConfig.train_files=['{bpe_store}']"], ["{bpe_store}: tokenized with 'bpe@sha256:"]),
    (["DataConfig.blend=(1, '{text}', 1, '{big_ids}')"], ["{big_ids}: token id 7000 does not fit"]),
    (["DataConfig.train_files=['{empty}']"], ["{empty}", "empty"]),
    (["DataConfig.train_files=['{truncated_store}']"], ["{truncated_store}/tokens.bin", "truncated or corrupt"]),
    (["DataConfig.train_files=['{truncated_idx}']"], ["{truncated_idx}.idx", "truncated or corrupt"]),
], ids=["weight_zero", "unpaired", "other_tokenizer", "ids_past_vocabulary", "empty_source", "truncated_store",
        "truncated_idx"])
def test_bad_data_source_exits_2_naming_it(corpora, tmp_path, capsys, bindings, names):
    workdir = tmp_path / "run"
    paths = {"text": str(corpora / "a.txt"), **{name: str(corpora / name) for name in
                                                 ("bytes_store", "bpe_store", "big_ids", "empty", "truncated_store",
                                                  "truncated_idx")}}
    args = [f"--workdir={workdir}", *TINY, *[f"--gin_param={b.format(**paths)}" for b in bindings]]
    gin.clear_config()
    handler_before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        train.main(args)
    gin.clear_config()
    # the CLI's start-up signal handling ends with it: left behind, a later SIGTERM to this
    # process (pytest's worker) would end it with exit 0
    assert signal.getsignal(signal.SIGTERM) is handler_before
    time.sleep(0.05)  # the watcher thread returns once it reads its pipe's end
    assert not [t for t in threading.enumerate() if t.name == "jaxtrain-startup-signals"]
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.strip().startswith("error: ") and len(err.strip().splitlines()) == 1, err
    for name in names:
        assert name.format(**paths) in err, err
    assert not workdir.exists()
