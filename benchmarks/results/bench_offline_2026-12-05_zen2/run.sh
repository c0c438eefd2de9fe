set -x
cd /work/main
uptime
for r in 1 2; do
for kv in auto fp8; do
.venv/bin/fp8serve --log-level WARNING bench throughput --kv-cache-dtype $kv --kv-cache-memory 2GiB --input-len 512 --output-len 128 --num-prompts 64 --output-json /tmp/bt/tp_${kv}_$r.json 2>/dev/null
done; done
for r in 1 2; do
for kv in auto fp8; do
.venv/bin/fp8serve --log-level WARNING bench latency --kv-cache-dtype $kv --kv-cache-memory 2GiB --batch-size 8 --input-len 512 --output-len 128 --num-iters-warmup 2 --num-iters 5 --output-json /tmp/bt/lat_${kv}_$r.json 2>/dev/null
done; done
uptime
