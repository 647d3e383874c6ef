# the README's fine-tuning command on CUDA: a full fine-tune of the random-weight 1B llama's F32 GGUF, 4 x 2048 tokens
export PYTHONPATH=$PWD/build/lb-cuda:/tmp/site LLAMABIND_CACHE=/tmp/llamabind-cache PYTHONUNBUFFERED=1
python3 -c "d=open('vendor/llama.cpp/docs/build.md').read(); open('/tmp/text.txt','w').write((d*(400000//len(d)+1))[:400000])"
/usr/bin/time -v timeout ${LB_CLI_TIMEOUT:-150} python3 -m llamabind finetune -m /tmp/lb-models/llama-1b-f32.gguf --data /tmp/text.txt \
  --batch 4 --ctx-size 2048 --iters 12 -o /tmp/tuned.gguf --no-progress > $OUT/cli-finetune-2048x4.log 2>&1
echo "cli rc=$?"; grep -vE "^(llama|load|print_info|common|ggml|init)" $OUT/cli-finetune-2048x4.log | grep -v "^\s*$" | tail -30
