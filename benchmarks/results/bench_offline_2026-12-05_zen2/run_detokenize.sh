cd /work/main
for r in 1 2; do
for d in "" "--disable-detokenize"; do
.venv/bin/fp8serve --log-level WARNING bench throughput --kv-cache-dtype fp8 --kv-cache-memory 1GiB --input-len 128 --output-len 128 --num-prompts 64 $d --output-json /tmp/dt/tp_${r}${d:+_nodetok}.json 2>/dev/null
done; done
