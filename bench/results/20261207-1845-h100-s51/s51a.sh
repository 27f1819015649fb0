# s51a: GPU tests of branches padtok (.carry/pt) and argmax1 (.carry/am); overlap batch 1 and 32 on main, padtok,
# argmax1 in one call (#30 item 1, #25)
set -u
export PYTHONUNBUFFERED=1
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
root=$PWD
cd $root/.carry/pt
PYTHONPATH=src timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/megakernel/test_batch_gpu.py tests/engine/test_megakernel_backend_gpu.py -m gpu -k "(1x1x1x1x1 and (llama-3.2-1b or smollm2)) or prepare_captures" > $OUT/tests.log 2>&1
echo "pt tests rc $?: $(tail -n 1 $OUT/tests.log)"; grep -E '^(FAILED|ERROR|E  )' $OUT/tests.log | head -8
cd $root/.carry/am
PYTHONPATH=src timeout 50 python3 -m pytest -q -p no:cacheprovider -rfE tests/engine/test_sampling.py -m gpu > $OUT/tests-am.log 2>&1
echo "am tests rc $?: $(tail -n 1 $OUT/tests-am.log)"; grep -E '^(FAILED|ERROR|E  )' $OUT/tests-am.log | head -8
mkdir -p $OUT/ov
for t in main pt am; do
  if [ $t = main ]; then cd $root; else cd $root/.carry/$t; fi
  PYTHONPATH=src timeout 100 python3 -m mimw.bench.overlap --model llama-3.2-1b --backend megakernel --batches 1,32 --tokens 128 --out /tmp/ov-$t > /tmp/ov-$t.log 2>&1
  echo "$t rc $?"; grep -E '^\[overlap\] batch' /tmp/ov-$t.log | cut -c1-600; grep -E 'rror' /tmp/ov-$t.log | tail -2
  cat /tmp/ov-$t.log >> $OUT/ov/$t.log
done
cd $root/.carry/am
PYTHONPATH=src timeout 70 python3 -m mimw.bench.overlap --model llama-3.2-1b --backend megakernel --batches 1 --tokens 128 --profile --out /tmp/prof > $OUT/ov/prof-am.log 2>&1
echo "prof rc $?"; grep -E "profile|gap|idle| us" $OUT/ov/prof-am.log | grep -v "^\[overlap\] batch" | head -40 | cut -c1-250
