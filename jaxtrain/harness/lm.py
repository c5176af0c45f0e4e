"""jaxtrain as a model backend of EleutherAI's lm-evaluation-harness, registered as `jaxtrain`.

    lm_eval.simple_evaluate(model="jaxtrain", model_args="workdir=W,batch_size=16", tasks=[...])
    python -m jaxtrain.harness run --model jaxtrain --model_args hf_dir=D,layout=data=2:tensor=2 \
        --batch_size 16 --tasks ...

The model comes from a training workdir (its newest intact checkpoint, on the run's layout or
`layout=`), a converted Hugging Face directory (`hf_dir=`, on `layout=` or one device) or a `Run`
in Python (`JaxtrainLM(run=run, tokenizer=tok)`). Requests are tokenized as the harness's HF
backend tokenizes them (the tokenizer's own special tokens, the BOS/EOS prefix for an empty
context, the trailing-space rule), so the two backends score the same token sequences.

- loglikelihood: jaxtrain/harness/scoring.py, a compiled program per length bucket;
- loglikelihood_rolling: the harness's disjoint windows of `max_length` tokens, scored the same way;
- generate_until: the generation engine (KV, latent or state caches), greedy unless the task
  samples, stopped at the task's stop sequences, EOS or `max_gen_toks`.
"""
from __future__ import annotations

import json
import os

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxtrain.harness.scoring import TokenScorer

DEFAULT_MAX_LENGTH = 2048  # the harness's HF backend's default where a model names no length
DEFAULT_MAX_GEN_TOKS = 256


def _as_int(name: str, value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a whole number, got {value!r}") from None


def load_source(workdir: str | None, hf_dir: str | None, layout: str | None, gin_ready: bool = False):
    """(the `Loaded` model of a workdir or an HF directory (jaxtrain/generate/loading.py), the
    longest request it scores by default: the HF config's positions, or the run's seq_len).
    `gin_ready`: the workdir's config is parsed already (the CLI parses it before jax starts)."""
    from jaxtrain.generate import loading

    if (workdir is None) == (hf_dir is None):
        raise ValueError("give exactly one of workdir=, hf_dir= (or run= in Python)")
    if hf_dir is not None:
        if not os.path.isdir(hf_dir):
            raise ValueError(f"hf_dir {hf_dir}: not a directory")
        loaded = loading.load_hf_dir(hf_dir, layout)
        return loaded, loaded.max_positions
    from jaxtrain.training.config import load_experiment, parse_gin

    if not gin_ready:
        saved = os.path.join(workdir, "config.gin")
        if not os.path.exists(saved):
            raise ValueError(f"{saved} not found: not a training workdir")
        parse_gin([saved], [f"Experiment.layout={json.dumps(layout)}"] if layout else [])
    exp = load_experiment()
    if not exp.data.tokenizer or exp.data.tokenizer == "bytes" or not os.path.isdir(exp.data.tokenizer):
        raise ValueError(f"{workdir}: its run has no Hugging Face tokenizer (DataConfig.tokenizer="
                         f"{exp.data.tokenizer!r}); the harness passes text, so it needs the model's tokenizer "
                         "directory")
    return loading.load_workdir(workdir), exp.train.seq_len


@register_model("jaxtrain")
class JaxtrainLM(TemplateLM):
    """model_args: workdir= | hf_dir= (| run= and tokenizer= in Python), layout= (parts separated by
    "," in Python, by ":" inside --model_args: `layout=data=2:tensor=2`), batch_size=, max_length=,
    max_gen_toks=, add_bos_token=, prefix_token_id=, seed= (sampled generation)."""

    def __init__(self, workdir: str | None = None, hf_dir: str | None = None, run=None, layout: str | None = None,
                 batch_size: int | str = 8, max_length: int | None = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 add_bos_token: bool | None = None, prefix_token_id: int | None = None, tokenizer=None,
                 seed: int = 0, gin_ready: bool = False, loaded=None, device=None, max_batch_size=None, **unused):
        super().__init__()  # device, max_batch_size: the harness's CLI passes them; the layout places the model
        if unused:
            raise ValueError(f"unknown model_args for jaxtrain: {', '.join(sorted(unused))} (known: workdir, hf_dir, "
                             "layout, batch_size, max_length, max_gen_toks, add_bos_token, prefix_token_id, seed)")
        if batch_size == "auto" or str(batch_size).startswith("auto"):
            batch_size = 8  # compiled programs have a fixed batch: "auto" takes the default
        batch_size = _as_int("batch_size", batch_size)
        # `--model_args` is comma-separated, so a layout there separates its parts by ":"
        layout = str(layout).replace(":", ",") if layout else None
        if loaded is not None:  # a model already on its mesh (jaxtrain/harness/training.py)
            default_length = loaded.max_positions
        elif run is not None:
            loaded, default_length = self._from_run(run, tokenizer), run.train.seq_len
        else:
            loaded, default_length = load_source(workdir, hf_dir, layout, gin_ready)
        if loaded.tokenizer is None or not hasattr(loaded.tokenizer, "hf_tokenizer"):
            where = hf_dir or "this run"
            raise ValueError(f"{where} has no Hugging Face tokenizer (tokenizer.json / tokenizer_config.json); the "
                             "harness passes text, so it needs the model's tokenizer")
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer.hf_tokenizer
        self.add_bos_token = None if add_bos_token is None else str(add_bos_token).lower() in ("true", "1")
        self.custom_prefix_token_id = None if prefix_token_id is None else _as_int("prefix_token_id", prefix_token_id)
        self._max_length = _as_int("max_length", max_length) if max_length is not None else default_length
        if self._max_length is not None and self._max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self._max_length}")
        self._max_gen_toks = _as_int("max_gen_toks", max_gen_toks)
        self.seed = _as_int("seed", seed)
        self.scorer = TokenScorer(loaded.model, mesh=loaded.mesh, rules=loaded.rules, batch_size=batch_size)
        self._engine = None

    @staticmethod
    def _from_run(run, tokenizer):
        """The run's current parameters on its own mesh; `tokenizer`: an HFTokenizer or its directory."""
        from jaxtrain.data.tokenizer import HFTokenizer
        from jaxtrain.generate.loading import Loaded, canonical_model

        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = HFTokenizer(os.fspath(tokenizer))
        model = canonical_model(run.setup.state.model_cfg, run.params)
        return Loaded(model, run.setup.mesh, run.setup.rules, tokenizer, None)

    def set_model(self, model) -> None:
        """New parameters for the same model on the same mesh: the compiled programs are reused."""
        from flax import nnx

        self.loaded.model = model
        self.scorer.set_state(nnx.state(model))
        if self._engine is not None:
            self._engine.state = nnx.state(model)

    # -- what the harness asks of a backend ------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self._max_length or DEFAULT_MAX_LENGTH

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self.scorer.batch_size

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As the HF backend encodes: the tokenizer's own special tokens unless told otherwise,
        none when the text already starts with the prefix token."""
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            add_special_tokens = False
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return list(self.tokenizer.encode(string, **options))

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def check_request_kinds(self, kinds) -> None:
        """ValueError, before anything compiles, for request kinds this model's layout cannot serve
        (generation under context parallelism)."""
        if "generate_until" in kinds:
            from jaxtrain.generate.engine import check_generation_layout

            check_generation_layout(self.loaded.mesh)

    # -- scoring ---------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(logprob, is_greedy) of each (key, context tokens, continuation tokens); a request
        longer than max_length + 1 keeps its last tokens, as the HF backend truncates."""
        sequences = []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("a loglikelihood request has an empty continuation")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens exceeds max_length={self.max_length}")
            sequences.append(((list(context) + list(continuation))[-(self.max_length + 1):], len(continuation)))
        scored = self.scorer.score(sequences)
        out = []
        for (key, _, _), result in zip(requests, scored):
            answer = (result.logprob, result.greedy)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood over the harness's disjoint windows of max_length
        tokens, every token predicted once, the first from the prefix token."""
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, predicted in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, predicted))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows) if windows else []):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ------------------------------------------------------------------------------
    def engine(self):
        if self._engine is None:
            self._engine = self.loaded.engine()  # refuses a context-parallel layout, before compiling
        return self._engine

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests grouped by their generation settings, each group generated in batches."""
        from jaxtrain.generate.sampling import Sampling

        engine = self.engine()
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        results: list[str | None] = [None] * len(requests)
        for indices in groups.values():
            options = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(options.pop("until", None), eos=eos)
            max_gen_toks = options.pop("max_gen_toks")
            sampling = Sampling(float(options.pop("temperature", 0.0)) if options.pop("do_sample", False) else 0.0,
                                int(options.pop("top_k", 0) or 0), float(options.pop("top_p", 1.0) or 1.0))
            if max_gen_toks >= self.max_length:
                raise ValueError(f"max_gen_toks={max_gen_toks} leaves no room for a prompt in max_length="
                                 f"{self.max_length}")
            # the longest first: a batch's prompts share a padded length
            indices = sorted(indices, key=lambda i: -len(self.tok_encode(requests[i].args[0])))
            for start in range(0, len(indices), self.batch_size):
                batch = indices[start:start + self.batch_size]
                prompts = [self.tok_encode(requests[i].args[0])[-(self.max_length - max_gen_toks):] for i in batch]
                new = self._generate(engine, prompts, max_gen_toks, sampling, until)
                for i, tokens in zip(batch, new):
                    text = postprocess_generated_text(self.tok_decode(tokens), until, None)
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results

    def _generate(self, engine, prompts, max_gen_toks: int, sampling, until: list[str]) -> list[list[int]]:
        """Each prompt's new tokens; the batch stops early once every row's text holds a stop
        sequence (what comes after one is cut anyway) or has ended."""
        rows = [[] for _ in prompts]
        ended = [False] * len(prompts)
        pad = self.tokenizer.pad_token_id
        for tokens in engine.stream(prompts, max_new_tokens=max_gen_toks, sampling=sampling, seed=self.seed,
                                    eos_id=self.eot_token_id, pad_id=self.eot_token_id if pad is None else pad):
            for r, token in enumerate(tokens):
                if token < 0:
                    ended[r] = True
                    continue
                rows[r].append(int(token))
                if not ended[r] and any(stop and stop in self.tok_decode(rows[r]) for stop in until):
                    ended[r] = True
            if all(ended):
                break
        return rows
