#!/bin/bash
# A new user's first try, step by step, timed: Broky from a fresh clone of this
# repository (./run serve, a subscriber, a publish, a first error, CLI start-up),
# then the same steps for nats-server (Debian's package, on PATH) and nats.py
# (from PyPI, in a fresh venv). Everything happens in a temporary directory,
# removed at the end; pip's cache is used as it is (say whether it was warm).
#
#     bench/first_try.sh [REPO]       (default: this checkout; commits, not the work tree)
#
# Results of one run: bench/results/first_try.md.
set -u
SRC=${1:-$(cd "$(dirname "$0")/.." && pwd)}
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT; cd "$W"
t() { date +%s.%N; }
el() { python3 -c "print(f'{$2-$1:.2f}')"; }
T0=$(t)
git clone -q $SRC broky; cd broky
T1=$(t); echo "clone: $(el $T0 $T1) s"
PORT=${BROKY_TRY_PORT:-47701}; MPORT=$((PORT + 1))
./run serve --port $PORT --metrics-port $MPORT > ../serve.log 2>&1 & SPID=$!
until grep -q "ready" ../serve.log 2>/dev/null; do sleep 0.05; kill -0 $SPID 2>/dev/null || { echo serve died; cat ../serve.log; exit 1; }; done
T2=$(t); echo "./run serve, first time, to ready: $(el $T1 $T2) s; .venv $(du -sh .venv | cut -f1)"
.venv/bin/broky sub 'demo.>' --count 1 --server 127.0.0.1:$PORT > ../sub.out 2> ../sub.err & SUB=$!
until grep -q . ../sub.err 2>/dev/null; do sleep 0.02; done
T3=$(t)
.venv/bin/broky pub demo.hello hi --server 127.0.0.1:$PORT > ../pub.out
wait $SUB; T4=$(t)
echo "sub ready: $(el $T2 $T3) s; pub until the sub printed it: $(el $T3 $T4) s; got: $(cat ../sub.out); pub said: $(cat ../pub.out)"
echo "clone to first delivered message: $(el $T0 $T4) s"
TE=$(t); .venv/bin/broky pub demo.hello hi --server 127.0.0.1:$((MPORT)) 2> ../err.out; TF=$(t)
echo "first error (pub at the metrics port): $(el $TE $TF) s: $(cat ../err.out)"
for c in "--help" "pub --help"; do
  python3 - "$c" <<'PY'
import subprocess,sys,time,statistics
a=sys.argv[1].split(); xs=[]
for _ in range(10):
    t=time.perf_counter(); subprocess.run([".venv/bin/broky",*a],capture_output=True); xs.append(time.perf_counter()-t)
print(f"broky {sys.argv[1]}: median {statistics.median(xs)*1000:.0f} ms")
PY
done
python3 - $PORT <<'PY'
import subprocess,sys,time,statistics
xs=[]
for _ in range(10):
    t=time.perf_counter(); subprocess.run([".venv/bin/broky","pub","demo.x","v","--quiet","--server",f"127.0.0.1:{sys.argv[1]}"],capture_output=True); xs.append(time.perf_counter()-t)
print(f"broky pub demo.x v (to a server): median {statistics.median(xs)*1000:.0f} ms")
PY
kill $SPID; wait $SPID 2>/dev/null
cd $W
# nats-server (Debian package) + nats.py from PyPI
N0=$(t)
python3 -m venv natsenv && natsenv/bin/pip install -q nats-py
N1=$(t); echo "nats: venv + pip install nats-py: $(el $N0 $N1) s; venv $(du -sh natsenv | cut -f1)"
nats-server -p 47711 > nats.log 2>&1 & NPID=$!
until grep -q "Server is ready" nats.log; do sleep 0.02; done
N2=$(t); echo "nats-server to ready: $(el $N1 $N2) s"
cat > first.py <<'PY'
import asyncio, nats
async def main():
    nc = await nats.connect("nats://127.0.0.1:47711")
    sub = await nc.subscribe("demo.>")
    await nc.publish("demo.hello", b"hi")
    msg = await sub.next_msg(timeout=5)
    print(msg.data.decode())
    await nc.close()
asyncio.run(main())
PY
natsenv/bin/python first.py > nats_first.out; N3=$(t)
echo "nats.py first pub/sub program: $(el $N2 $N3) s; got $(cat nats_first.out)"
echo "nats: venv to first delivered message: $(el $N0 $N3) s"
cat > err.py <<'PY'
import asyncio, nats, time
async def main():
    t=time.perf_counter()
    try:
        await nats.connect("nats://127.0.0.1:47712", max_reconnect_attempts=0, connect_timeout=5, allow_reconnect=False)
    except Exception as e:
        print(f"{time.perf_counter()-t:.2f} s: {type(e).__name__}: {e}")
asyncio.run(main())
PY
python3 -m http.server 47712 --bind 127.0.0.1 > /dev/null 2>&1 & HP=$!; sleep 0.5
echo "nats.py at an HTTP server: $(natsenv/bin/python err.py 2>&1 | tail -1)"
kill $HP $NPID
python3 - <<'PY'
import subprocess,time,statistics
for cmd in (["nats-server","--version"],["redis-cli","--version"],["python3","-c","pass"]):
    xs=[]
    for _ in range(10):
        t=time.perf_counter(); subprocess.run(cmd,capture_output=True); xs.append(time.perf_counter()-t)
    print(f"{' '.join(cmd)}: median {statistics.median(xs)*1000:.0f} ms")
PY
