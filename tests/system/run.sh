#!/usr/bin/env bash
# System test: the Debian package under a real systemd. Builds the .deb (cargo deb), a minimal
# Debian 12 rootfs (mmdebstrap from Debian's packages, cached), installs the package there with
# dpkg, boots the rootfs with systemd-nspawn (systemd as the container's PID 1) and checks what
# an operator relies on: the package's user, groups and enabled-not-started unit; a start while
# unconfigured that waits for the recordings folder, and one clean failed start (status 2, no
# restart loop) for a configuration error; a failure that may pass (ingest.device = cuda without
# a GPU) waited for in the running process, and a new device heard at `systemctl reload`; READY=1; STATUS=; journal fields FILE and
# REASON; `systemctl reload` accepted (exit 0) and refused (non-zero); the metrics textfile and
# (with the drop-in docs/operations.md gives) the HTTP endpoint;
# new recordings ingested; watchdog restart after SIGSTOP; clean stop. Powers the container off.
#
# Usage (root, from anywhere):   tests/system/run.sh            # builds the .deb with cargo deb
#                                DEB=path/to/ailhd.deb tests/system/run.sh
# Env: W=work dir (default target/system-test), CACHE=rootfs cache folder (default
# /var/cache/ailhd-system-test), FRESH=1 rebuilds the rootfs, KEEP=1 leaves the container up,
# MIRROR=Debian mirror URL (default: this host's apt mirror, else deb.debian.org).
# Needs: root, systemd-nspawn (systemd-container), mmdebstrap, zstd (installed with apt-get
# when missing), network access to a Debian mirror for the first rootfs, cargo-deb for the .deb.
# Not in CI: see docs/operations.md, "System test".
set -uo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
W=${W:-$REPO/target/system-test}
CACHE=${CACHE:-/var/cache/ailhd-system-test}
ROOT=$W/root
OUT=$W/out
MACHINE=ailhd-systest
TARBALL=$CACHE/bookworm-systemd-minbase.tar.zst
mkdir -p "$W" "$OUT" "$CACHE"
: > "$OUT/summary.txt"

T0=$(date +%s.%N); step_t=$T0
step() {
  local now; now=$(date +%s.%N)
  awk -v a="$now" -v b="$T0" -v c="$step_t" -v m="$*" \
    'BEGIN{printf "[%6.1fs] (+%5.1fs) %s\n", a-b, a-c, m}' | tee -a "$OUT/summary.txt"
  step_t=$now
}
PASS=0; FAIL=0
ok()   { echo "PASS: $*" | tee -a "$OUT/summary.txt"; PASS=$((PASS+1)); }
bad()  { echo "FAIL: $*" | tee -a "$OUT/summary.txt"; FAIL=$((FAIL+1)); }
check(){ local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
die()  { echo "system test: $*" >&2; exit 2; }

[ "$(id -u)" = 0 ] || die "must run as root (systemd-nspawn, chroot)"

# ------------------------------------------------------------------ host tools
step "host tools"
if ! command -v systemd-nspawn >/dev/null || ! command -v mmdebstrap >/dev/null || ! command -v zstd >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-upgrade \
    systemd-container mmdebstrap zstd >/dev/null || die "cannot install systemd-container mmdebstrap zstd"
fi

# ------------------------------------------------------------------ the package
if [ -z "${DEB:-}" ]; then
  step "cargo deb"
  command -v cargo-deb >/dev/null || die "cargo-deb is needed (cargo install cargo-deb), or give DEB=path"
  (cd "$REPO" && cargo deb) > "$OUT/cargo-deb.log" 2>&1 || { tail -20 "$OUT/cargo-deb.log"; die "cargo deb failed"; }
  DEB=$(ls -t "${CARGO_TARGET_DIR:-$REPO/target}"/debian/ailhd_*.deb | head -1)
fi
[ -f "$DEB" ] || die "no package at $DEB"
dpkg-deb --info "$DEB" > "$OUT/deb-info.txt"; dpkg-deb --contents "$DEB" > "$OUT/deb-contents.txt"
echo "package: $DEB ($(du -h "$DEB" | cut -f1))" | tee -a "$OUT/summary.txt"

# ------------------------------------------------------------------ rootfs
if [ -e "$W/nspawn.pid" ] && kill -0 "$(cat "$W/nspawn.pid")" 2>/dev/null; then
  die "a container from a previous run is still up (pid $(cat "$W/nspawn.pid")); power it off first"
fi
rm -rf "$ROOT"
if [ -z "${FRESH:-}" ] && [ -s "$TARBALL" ]; then
  step "rootfs: from the cache $TARBALL"
  mkdir -p "$ROOT" && tar -C "$ROOT" --zstd -xpf "$TARBALL"
else
  step "rootfs: mmdebstrap bookworm minbase + systemd"
  uris=$(grep -h "^URIs:" /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}')
  MIRROR=${MIRROR:-$(echo "$uris" | grep -v security | head -1)}
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
  SECMIRROR=$(echo "$uris" | grep security | head -1); SECMIRROR=${SECMIRROR:-http://deb.debian.org/debian-security}
  mmdebstrap --variant=minbase --include=systemd,systemd-sysv,dbus,procps,init-system-helpers \
    bookworm "$ROOT" "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
    "deb $SECMIRROR bookworm-security main" > "$OUT/mmdebstrap.log" 2>&1 \
    || { tail "$OUT/mmdebstrap.log"; die "mmdebstrap failed"; }
  tar -C "$ROOT" --zstd -cpf "$TARBALL" .
fi

# ------------------------------------------------------------------ install the package (dpkg, as an operator would)
step "dpkg -i in the rootfs"
had_render=no; chroot "$ROOT" getent group render >/dev/null && had_render=yes
echo "render group before install: $had_render" | tee -a "$OUT/summary.txt"
cp "$DEB" "$ROOT/tmp/ailhd.deb"
chroot "$ROOT" dpkg -i /tmp/ailhd.deb > "$OUT/dpkg.log" 2>&1 || { cat "$OUT/dpkg.log"; die "dpkg -i failed"; }
check "package created the ailhd user" chroot "$ROOT" getent passwd ailhd
check "package created the render and video groups" chroot "$ROOT" getent group render video
check "unit enabled by the package" [ "$(chroot "$ROOT" systemctl is-enabled ailhd 2>/dev/null)" = enabled ]
conffile() { chroot "$ROOT" dpkg-query -W -f='${Conffiles}' ailhd | grep -q /etc/ailhd/ailhd.toml; }
check "/etc/ailhd/ailhd.toml is a conffile" conffile
echo "$MACHINE" > "$ROOT/etc/hostname"

# ------------------------------------------------------------------ boot
boot() {
  (SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1 setsid systemd-nspawn -D "$ROOT" -M "$MACHINE" -b \
      --register=no --keep-unit --private-network --console=read-only --system-call-filter=bpf \
      > "$OUT/nspawn.log" 2>&1 < /dev/null & echo $! > "$W/nspawn.pid")
  NSPAWN_PID=$(cat "$W/nspawn.pid"); CPID=
  for _ in $(seq 1 100); do
    for c in $(cat /proc/"$NSPAWN_PID"/task/*/children 2>/dev/null); do
      [ "$(cat /proc/"$c"/comm 2>/dev/null)" = systemd ] && CPID=$c
    done
    [ -n "$CPID" ] && break; sleep 0.1
  done
  [ -n "$CPID" ] || { cat "$OUT/nspawn.log"; die "the container's init did not start"; }
  for _ in $(seq 1 150); do
    st=$(C systemctl is-system-running 2>/dev/null); case "$st" in running|degraded) break;; esac; sleep 0.1
  done
}
C() { nsenter -t "$CPID" -a env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        TERM=dumb SYSTEMD_COLORS=0 SYSTEMD_PAGER= LANG=C.UTF-8 "$@"; }
J() { C journalctl -u ailhd --no-pager "$@"; }
prop() { C systemctl show ailhd -p "$1" --value; }
poweroff() {
  C systemctl poweroff >/dev/null 2>&1 || true
  for _ in $(seq 1 100); do kill -0 "$NSPAWN_PID" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$NSPAWN_PID" 2>/dev/null && { kill "$NSPAWN_PID"; sleep 2; }
  rm -f "$W/nspawn.pid"
}
trap '[ -z "${KEEP:-}" ] && [ -n "${NSPAWN_PID:-}" ] && kill -0 "$NSPAWN_PID" 2>/dev/null && poweroff' EXIT

step "boot, unconfigured (the shipped configuration names a recordings folder that does not exist)"
boot
echo "container PID 1 = host pid $CPID; $(C systemctl is-system-running)" | tee -a "$OUT/summary.txt"
sleep 3   # RestartSec=2: a restart loop would show by now
J -o cat > "$OUT/unconfigured.txt"
cat "$OUT/unconfigured.txt" | tail -4 | tee -a "$OUT/summary.txt"
check "unconfigured: active, waiting for the recordings folder" [ "$(C systemctl is-active ailhd)" = active ]
check "unconfigured: not restarted (no loop)" [ "$(prop NRestarts)" = 0 ]
check "unconfigured: the journal names paths.recordings, not there" grep -q 'paths.recordings = .*no such folder' "$OUT/unconfigured.txt"

step "a configuration error: one failed start, exit status 2, not restarted"
sed -i 's/^idle_close_s = [0-9]*/idle_close_s = "soon"/' "$ROOT/etc/ailhd/ailhd.toml"
grep -q '^idle_close_s = "soon"' "$ROOT/etc/ailhd/ailhd.toml" || die "the shipped configuration has no idle_close_s line to break"
C systemctl restart ailhd
sleep 3   # RestartSec=2: a restart loop would show by now
J -n 6 -o cat > "$OUT/misconfigured.txt"
tail -3 "$OUT/misconfigured.txt" | tee -a "$OUT/summary.txt"
check "misconfigured: exit status 2" [ "$(prop ExecMainStatus)" = 2 ]
check "misconfigured: not restarted (no loop)" [ "$(prop NRestarts)" = 0 ]
check "misconfigured: the journal names the key" grep -q 'idle_close_s' "$OUT/misconfigured.txt"

# ------------------------------------------------------------------ a failure that may pass
step "a failure that may pass (ingest.device = cuda, no GPU here): waited for, no restart; a new device heard at reload"
mkdir -p "$ROOT/srv/ailhd/recordings"
for l in BACKGROUND CRACK LEAK NORMAL UNCLASSIFIED; do mkdir -p "$ROOT/srv/ailhd/recordings/$l"; done
cat > "$ROOT/etc/ailhd/ailhd.toml" <<'EOF'
[paths]
recordings = "/srv/ailhd/recordings"
output = "/var/lib/ailhd/output"
state = "/var/lib/ailhd/state"

[ingest]
device = "cuda"
EOF
C systemctl reset-failed ailhd
C systemctl restart ailhd
sleep 16   # a restart loop (RestartSec=2) would show by now, and two looks for the GPU have run
echo "after 16 s: $(C systemctl is-active ailhd), NRestarts $(prop NRestarts), MainPID $(prop MainPID), StatusText $(prop StatusText | cut -c1-90)" | tee -a "$OUT/summary.txt"
PID_WAITING=$(prop MainPID)
check "cuda without a GPU: active, not restarted" [ "$(C systemctl is-active ailhd) $(prop NRestarts)" = "active 0" ]
case "$(prop StatusText)" in "waiting: ingest.device = cuda"*) SAID=yes;; *) SAID=no;; esac
check "cuda without a GPU: the status line says why it waits" [ "$SAID" = yes ]
case "$(C ailhd status 2>&1)" in *"has been waiting"*) SAID=yes;; *) SAID=no;; esac
check "cuda without a GPU: ailhd status says it waits" [ "$SAID" = yes ]
sed -i 's/^device = "cuda"/device = "cpu"/' "$ROOT/etc/ailhd/ailhd.toml"
C systemctl reload ailhd
sleep 3
echo "after the reload: $(prop StatusText | cut -c1-60), MainPID $(prop MainPID)" | tee -a "$OUT/summary.txt"
case "$(prop StatusText)" in *ingested*) SAID=yes;; *) SAID=no;; esac
check "a device written meanwhile is heard at reload: running on the CPU" [ "$SAID" = yes ]
check "... in the same process" [ "$(prop MainPID)" = "$PID_WAITING" ]
C systemctl stop ailhd
C systemctl reset-failed ailhd 2>/dev/null

# ------------------------------------------------------------------ configure and start
step "configure, start"
cat > "$ROOT/etc/ailhd/ailhd.toml" <<'EOF'
[paths]
recordings = "/srv/ailhd/recordings"
output = "/var/lib/ailhd/output"
state = "/var/lib/ailhd/state"

[ingest]
quarantine_after_s = 5

[metrics]
textfile = "/var/lib/ailhd/metrics/ailhd.prom"
EOF
mkdir -p "$ROOT/var/lib/ailhd/metrics"; C chown ailhd:ailhd /var/lib/ailhd/metrics
C systemctl reset-failed ailhd
C systemd-analyze log-level debug
C systemctl start ailhd; echo "systemctl start rc=$?" | tee -a "$OUT/summary.txt"
C systemd-analyze log-level info
check "active after start" [ "$(C systemctl is-active ailhd)" = active ]
J -o short-precise | grep -E 'READY=1|start -> running' | cut -c1-170 > "$OUT/ready.txt"
ready_before_running() { awk '/READY=1/{r=NR} /start -> running/{s=NR} END{exit !(r && s && r < s)}' "$OUT/ready.txt"; }
check "READY=1 received, then start -> running" ready_before_running
C systemctl status ailhd --no-pager | sed -n 1,9p | tee "$OUT/status.txt"
check "STATUS= shown by systemctl status" grep -q 'Status: "' "$OUT/status.txt"
MAIN=$(prop MainPID)

step "journal fields of a quarantined file"
echo "this is not a wav" > "$ROOT/srv/ailhd/recordings/LEAK/x.wav"
for _ in $(seq 1 40); do J -o verbose --output-fields=FILE | grep -q 'FILE=LEAK/x.wav' && break; sleep 0.5; done
J -o verbose --output-fields=MESSAGE,PRIORITY,FILE,REASON -g 'quarantined LEAK/x.wav' | tee "$OUT/quarantine-verbose.txt"
check "journal FILE= of the quarantined file" grep -q '^ *FILE=LEAK/x.wav' "$OUT/quarantine-verbose.txt"
check "journal REASON= of the quarantined file" grep -q '^ *REASON=' "$OUT/quarantine-verbose.txt"

step "reload: accepted, then refused"
printf '\n# reload test\n' >> "$ROOT/etc/ailhd/ailhd.toml"
C systemctl reload ailhd; rc=$?
echo "systemctl reload (good configuration) rc=$rc" | tee -a "$OUT/summary.txt"
check "reload of a good configuration: exit 0" [ "$rc" = 0 ]
cp "$ROOT/etc/ailhd/ailhd.toml" "$W/good.toml"
sed -i 's/^quarantine_after_s = 5/quarantine_after_s = "soon"/' "$ROOT/etc/ailhd/ailhd.toml"
C systemctl reload ailhd 2> "$OUT/reload-refused.txt"; rc=$?
echo "systemctl reload (broken configuration) rc=$rc" | tee -a "$OUT/summary.txt"
J -n 4 -o cat | tee -a "$OUT/reload-refused.txt"
check "reload of a broken configuration: non-zero exit" [ "$rc" != 0 ]
check "the refusal names the key" grep -q quarantine_after_s "$OUT/reload-refused.txt"
cp "$W/good.toml" "$ROOT/etc/ailhd/ailhd.toml"
same_service() { [ "$(C systemctl is-active ailhd)" = active ] && [ "$(prop MainPID)" = "$MAIN" ]; }
check "still active, same main PID after the refused reload" same_service

step "20 new recordings"
python3 - "$ROOT/srv/ailhd/recordings" <<'EOF'
import math, os, random, struct, sys, wave
root = sys.argv[1]; rnd = random.Random(7)
labels = ["BACKGROUND", "CRACK", "LEAK", "NORMAL"]
for i in range(20):
    label = labels[i % 4]; f0 = rnd.uniform(50, 1500)
    frames = b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * f0 * n / 4096) + rnd.gauss(0, 300)))
                      for n in range(4096 * 10))
    name = f"S{i:03d}~R{i}~20250118{120000 + i:06d}~100.wav"
    tmp = os.path.join(root, label, "." + name + ".part")
    with wave.open(tmp, "wb") as w:
        w.setnchannels(1); w.setsampwidth(2); w.setframerate(4096); w.writeframes(frames)
    os.rename(tmp, os.path.join(root, label, name))
EOF
for _ in $(seq 1 120); do C ailhd status 2>/dev/null | grep -q 'committed 20' && break; sleep 0.5; done
C ailhd status | tee "$OUT/ailhd-status.txt"
check "ailhd status: committed 20" grep -q 'committed 20' "$OUT/ailhd-status.txt"
status_text() { C systemctl show ailhd -p StatusText --value | grep -q 'ingested 20'; }
check "STATUS= says ingested 20" status_text
C systemctl show ailhd -p StatusText | tee -a "$OUT/summary.txt"
prom() { grep -q "$1" "$ROOT/var/lib/ailhd/metrics/ailhd.prom"; }
for _ in $(seq 1 30); do prom 'ailhd_files_ingested_total 20' && break; sleep 0.5; done
grep -E '^ailhd_(files|up|device)' "$ROOT/var/lib/ailhd/metrics/ailhd.prom" | tee -a "$OUT/summary.txt"
check "metrics textfile: 20 ingested" prom 'ailhd_files_ingested_total 20'
check "metrics textfile: the quarantine, by kind of reason" prom '^ailhd_files_quarantined_total{reason="[a-z_]*"} 1$'

step "watchdog: SIGSTOP the main PID (WatchdogSec lowered to 10 s by a runtime drop-in)"
C sh -c 'mkdir -p /run/systemd/system/ailhd.service.d && printf "[Service]\nWatchdogSec=10\n" > /run/systemd/system/ailhd.service.d/watchdog.conf && systemctl daemon-reload'
C systemctl restart ailhd
MAIN=$(prop MainPID); NR=$(prop NRestarts)
C kill -STOP "$MAIN"; t=$(date +%s)
for _ in $(seq 1 60); do [ "$(prop NRestarts)" -gt "$NR" ] && [ "$(C systemctl is-active ailhd)" = active ] && break; sleep 1; done
echo "restarted after $(( $(date +%s) - t )) s; MainPID $MAIN -> $(prop MainPID), NRestarts $(prop NRestarts)" | tee -a "$OUT/summary.txt"
J -o short-precise --since "-70s" | grep -E 'Watchdog|SIGABRT|watchdog|Started' | cut -c1-200 | tee "$OUT/watchdog.txt"
check "watchdog timeout logged" grep -q 'Watchdog timeout' "$OUT/watchdog.txt"
check "restarted and active" [ "$(C systemctl is-active ailhd)" = active ]
committed20() { C ailhd status | grep -q 'committed 20'; }
check "state survived the watchdog kill (committed 20)" committed20
C sh -c 'rm -rf /run/systemd/system/ailhd.service.d && systemctl daemon-reload'

step "metrics endpoint: [metrics] listen, with the drop-in docs/operations.md gives"
C sh -c 'mkdir -p /etc/systemd/system/ailhd.service.d && printf "[Service]\nPrivateNetwork=no\nRestrictAddressFamilies=AF_UNIX AF_INET AF_INET6\nIPAddressAllow=localhost\n" > /etc/systemd/system/ailhd.service.d/metrics.conf && systemctl daemon-reload'
printf 'listen = "127.0.0.1:9187"\n' >> "$ROOT/etc/ailhd/ailhd.toml"
C systemctl restart ailhd
for _ in $(seq 1 50); do
  C bash -c 'exec 3<>/dev/tcp/127.0.0.1/9187 && printf "GET /metrics HTTP/1.0\r\n\r\n" >&3 && cat <&3' > "$OUT/metrics-http.txt" 2>/dev/null && break; sleep 0.2
done
head -1 "$OUT/metrics-http.txt" | tee -a "$OUT/summary.txt"
check "GET /metrics answers 200" grep -q '^HTTP/1.[01] 200' "$OUT/metrics-http.txt"
check "GET /metrics serves the families" grep -q '^ailhd_files{state="committed"} 20' "$OUT/metrics-http.txt"
sed -i '/^listen = /d' "$ROOT/etc/ailhd/ailhd.toml"
C sh -c 'rm -rf /etc/systemd/system/ailhd.service.d && systemctl daemon-reload && systemctl restart ailhd'
# The stop above runs under the base unit's IP filter again: the endpoint must not hold it up.
no_stop_timeout() { ! J | grep -q "State 'stop-sigterm' timed out"; }
check "stop with the endpoint open did not time out" no_stop_timeout

step "clean stop"
C systemctl stop ailhd
J -o short-precise -n 5 | cut -c1-200 | tee "$OUT/stop.txt"
check "stop: Result=success" [ "$(prop Result)" = success ]
check "stop: the service drained (its 'stopping:' line)" grep -q 'stopping:' "$OUT/stop.txt"
check "metrics textfile says ailhd_up 0 after the stop" prom '^ailhd_up 0'

J -o short-precise > "$OUT/journal-ailhd.txt"
step "done: $PASS passed, $FAIL failed (logs in $OUT)"
if [ -n "${KEEP:-}" ]; then
  echo "container left running: nsenter -t $CPID -a systemctl status ailhd; stop it with kill $NSPAWN_PID"
  trap - EXIT
else
  poweroff; trap - EXIT
fi
[ "$FAIL" = 0 ]
