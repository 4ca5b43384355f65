"""One process of the 2-process context-parallel check (run by tests/test_context_parallel.py).

    python -m tests.workers.context_multiprocess PROCESS_ID PORT

Each process owns 4 fake CPU devices; jax.distributed joins them into one 8-device mesh (gloo
collectives). Every process builds the same global inputs, runs context_attention and its gradients
across both processes, and checks the shards it holds against single-device attention."""

import os
import sys

os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=4 {os.environ.get('XLA_FLAGS', '')}".strip()

import jax

try:  # CPU collectives across processes (the default in newer jax)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
except (AttributeError, ValueError):
    pass


def main(process_id: int, port: str) -> None:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dsv_jax.attention import attention
    from dsv_jax.config import ParallelConfig
    from dsv_jax.parallel import context_attention, make_mesh
    from pallas_kernels.sparse_attention import sparse_attention_reference

    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = make_mesh(ParallelConfig(data=1, fsdp=1, context=8))
    b, s, h, d, tile = 1, 128, 8, 16, 16
    ks = jax.random.split(jax.random.key(5), 4)
    host = [np.asarray(jax.random.normal(kk, (b, s, h, d), jnp.float32)) for kk in ks]
    rng = np.random.default_rng(0)
    idx = np.sort(np.stack([rng.choice(s // tile, 4, replace=False) for _ in range(b * h * (s // tile))]), -1)
    idx = idx.reshape(b, h, s // tile, 4).astype(np.int32)
    cnt = np.broadcast_to(np.array([1, 2, 3, 4, 4, 3, 2, 1], np.int32)[None, :, None], (b, h, s // tile)).copy()

    seq = NamedSharding(mesh, P(None, "context"))
    tiles = NamedSharding(mesh, P(None, None, "context"))
    to_global = lambda x, sh: jax.make_array_from_callback(x.shape, sh, lambda i: x[i])
    q, k, v, cot = (to_global(x, seq) for x in host)
    g_idx, g_cnt = to_global(idx, tiles), to_global(cnt, tiles)

    def check(name, f, ref, *extra):
        def fwd_bwd(q, k, v, c, *extra):
            out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, *extra), q, k, v)
            return (out, *vjp(c))

        got = jax.jit(fwd_bwd)(q, k, v, cot, *extra)  # global arrays are arguments, never closed over
        out, vjp = jax.vjp(ref, *(jnp.asarray(x) for x in host[:3]))
        want = (out, *vjp(jnp.asarray(host[3])))
        for g, w in zip(got, want):
            for shard in g.addressable_shards:
                np.testing.assert_allclose(np.asarray(shard.data), np.asarray(w)[shard.index], atol=3e-5, rtol=1e-4)
        print(f"process {process_id}: {name} ok", flush=True)

    lens = jnp.array([100], jnp.int32)
    dense_ref = lambda q, k, v: attention(q, k, v, backend="xla", kv_lens=lens)
    for strategy, degrees, scp in (("ring", None, None), ("hybrid", (2, 4), "allgather")):
        check(
            strategy,
            lambda q, k, v: context_attention(
                q, k, v, mesh=mesh, strategy=strategy, degrees=degrees, scp=scp, kv_lens=lens
            ),
            dense_ref,
        )
    sparse_ref = lambda q, k, v: sparse_attention_reference(
        q, k, v, jnp.asarray(idx), jnp.asarray(cnt), q_tile=tile, kv_block=tile
    )
    check(
        "hybrid-selective",
        lambda q, k, v, i, c: context_attention(
            q,
            k,
            v,
            mesh=mesh,
            strategy="hybrid",
            degrees=(2, 4),
            scp="selective",
            kv_index=i,
            kv_count=c,
            q_tile=tile,
            kv_block=tile,
        ),
        sparse_ref,
        g_idx,
        g_cnt,
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
