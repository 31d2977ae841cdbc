#!/usr/bin/env bash
# A private RabbitMQ node for development, tests and CI: no system service, no root-owned state.
#
#   scripts/rabbitmq-local.sh up        start (idempotent); prints amqp://guest:guest@127.0.0.1:PORT/
#   scripts/rabbitmq-local.sh down      stop cleanly (rabbitmqctl shutdown)
#   scripts/rabbitmq-local.sh kill      SIGKILL the node (chaos tests); `up` restarts it on its ports
#   scripts/rabbitmq-local.sh status    exit 0 when the node is running and accepts AMQP
#   scripts/rabbitmq-local.sh url       print the AMQP URL of the running node
#   scripts/rabbitmq-local.sh management-url   print http://127.0.0.1:PORT/ of the management API
#   scripts/rabbitmq-local.sh tls-url   print amqps://guest:guest@localhost:PORT/ (see QLM_RABBITMQ_TLS_DIR)
#   scripts/rabbitmq-local.sh nodename  print the Erlang node name of this state dir
#   scripts/rabbitmq-local.sh version   print the installed server's version
#   scripts/rabbitmq-local.sh clean     stop and delete all state (queues and messages too)
#   scripts/rabbitmq-local.sh ctl ARGS  rabbitmqctl against this node (also: diag, queues)
#
# State lives in $QLM_HOME/rabbitmq (QLM_HOME defaults to <repo>/.qlm): mnesia, logs, pid,
# generated config and a private HOME holding the Erlang cookie. Ports are free ports picked
# at `up` time and the node name is derived from the state dir, so two checkouts on one
# machine never clash. Logs go to stderr; only URLs go to stdout.
#
# QLM_RABBITMQ_TLS_DIR=DIR (at `up`): also listen for AMQP over TLS (amqps) on a fourth private
# port, with DIR/cert.pem, DIR/key.pem and DIR/ca.pem (e.g. a self-signed test CA).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QLM_HOME="$(realpath -m "${QLM_HOME:-$REPO_ROOT/.qlm}")"
STATE="$QLM_HOME/rabbitmq"
RMQ_BIN="${QLM_RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}" # override: tests of the install path
START_TIMEOUT_S="${QLM_RABBITMQ_START_TIMEOUT_S:-60}"

log() { printf '[rabbitmq-local] %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

# The mnesia directory is tied to the node name, so the name must be stable per state dir.
NODE="qlm-$(printf '%s' "$STATE" | sha256sum | cut -c1-10)@localhost"

install_rabbitmq() {
	[[ -x $RMQ_BIN/rabbitmq-server ]] && return 0
	if [[ $(id -u) -ne 0 ]]; then
		die "RabbitMQ is not installed ($RMQ_BIN/rabbitmq-server missing) and we are not root." \
			"Install it with: sudo apt-get install -y rabbitmq-server (or set QLM_AMQP_URL)"
	fi
	log "installing rabbitmq-server with apt-get (one-time)"
	# The package's postinst must not start the system-wide service: refuse service starts
	# for the duration of the install unless the machine already has a policy.
	local policy=/usr/sbin/policy-rc.d added_policy=0
	if [[ ! -e $policy ]]; then
		printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && added_policy=1
	fi
	local rc=0
	{
		DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
				rabbitmq-server
	} </dev/null >&2 || rc=$?
	[[ $added_policy -eq 1 ]] && rm -f "$policy"
	[[ $rc -eq 0 ]] || die "apt-get install rabbitmq-server failed (rc=$rc)"
	[[ -x $RMQ_BIN/rabbitmq-server ]] || die "apt installed rabbitmq-server but $RMQ_BIN is missing"
}

# Environment shared by the server and the CLI tools: same node name, same private cookie,
# and nothing from /etc/rabbitmq.
node_env() {
	export HOME="$STATE/home"
	export PATH="$RMQ_BIN:$PATH"
	export RABBITMQ_NODENAME="$NODE"
	export RABBITMQ_CONF_ENV_FILE="$STATE/rabbitmq-env.conf"
	export RABBITMQ_CONFIG_FILE="$STATE/rabbitmq" # the .conf extension is implied
	export RABBITMQ_CONFIG_FILES="$STATE/conf.d"
	export RABBITMQ_ADVANCED_CONFIG_FILE="$STATE/advanced.config"
	export RABBITMQ_ENABLED_PLUGINS_FILE="$STATE/enabled_plugins"
	export RABBITMQ_MNESIA_BASE="$STATE/mnesia"
	export RABBITMQ_LOG_BASE="$STATE/log"
	export RABBITMQ_PID_FILE="$STATE/rabbitmq.pid"
	# Keep Erlang distribution and epmd on loopback (both default to 0.0.0.0).
	export ERL_EPMD_ADDRESS=127.0.0.1
	export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
	export RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
	if [[ -f $STATE/ports ]]; then
		# shellcheck source=/dev/null
		. "$STATE/ports"
		export RABBITMQ_DIST_PORT="$DIST_PORT"
	fi
}

read_ports() {
	[[ -f $STATE/ports ]] || return 1
	# shellcheck source=/dev/null
	. "$STATE/ports"
}

amqp_url() { printf 'amqp://guest:guest@127.0.0.1:%s/\n' "$AMQP_PORT"; }

tcp_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Our node's BEAM: the server (`-s rabbit boot`, not a CLI tool) whose environment names our
# node - so neither a recycled pid nor another checkout's node matches.
is_our_server() {
	local comm
	read -r comm 2>/dev/null <"/proc/$1/comm" || return 1
	[[ $comm == beam.smp ]] || return 1
	# (No `... | grep -q` under pipefail: an early grep exit fails the pipeline with SIGPIPE.)
	local environ cmdline
	environ="$(tr '\0' '\n' 2>/dev/null <"/proc/$1/environ")" || return 1
	cmdline="$(tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline")" || return 1
	[[ $'\n'$environ$'\n' == *$'\n'"RABBITMQ_NODENAME=$NODE"$'\n'* && $cmdline == *"-s rabbit boot"* ]]
}

# The pid file is written a moment into the boot; before that (e.g. when an `up` was
# interrupted), find the server by scanning /proc.
node_pid() {
	local pid d
	if [[ -f $STATE/rabbitmq.pid ]]; then
		pid="$(tr -dc '0-9' <"$STATE/rabbitmq.pid")"
		if [[ -n $pid ]] && is_our_server "$pid"; then
			printf '%s\n' "$pid"
			return 0
		fi
	fi
	for d in /proc/[0-9]*; do
		pid="${d#/proc/}"
		if is_our_server "$pid"; then
			printf '%s\n' "$pid"
			return 0
		fi
	done
	return 1
}

node_pid_alive() { node_pid >/dev/null; }

# Running = our BEAM is alive and its AMQP listener accepts connections.
is_running() { node_pid_alive && read_ports && tcp_open "$AMQP_PORT"; }

free_ports() {
	# Bind all four at once so they are distinct; the kernel picks unused ephemeral ports.
	python3 - <<'EOF'
import socket
socks = []
for _ in range(4):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

# Ports of the previous run when all three are still free (a restarted node keeps its URL, so
# clients reconnect to it); otherwise new free ports.
pick_ports() {
	if [[ ${1:-1} -eq 1 ]] && read_ports 2>/dev/null &&
		[[ -n ${TLS_PORT:-} ]] && ! tcp_open "$AMQP_PORT" && ! tcp_open "$MGMT_PORT" &&
		! tcp_open "$DIST_PORT" && ! tcp_open "$TLS_PORT"; then
		printf '%s %s %s %s\n' "$AMQP_PORT" "$MGMT_PORT" "$DIST_PORT" "$TLS_PORT"
		return 0
	fi
	free_ports
}

# The installed server's version, from its release directory (rabbitmq_server-X.Y.Z): known
# before the node runs, so the config can depend on it.
server_version() {
	local dir
	for dir in "$RMQ_BIN"/../lib/rabbitmq_server-*; do
		[[ -d $dir ]] && printf '%s\n' "${dir##*/rabbitmq_server-}" && return 0
	done
	return 1
}

# RabbitMQ < 3.12 ignores the shards' x-consumer-timeout argument: such a broker needs the
# broker-wide fallback (docker/rabbitmq-pre-3.12.conf). Unknown version: assume old (safe).
needs_global_consumer_timeout() {
	local version major minor
	version="$(server_version)" || return 0
	IFS=. read -r major minor _ <<<"$version"
	[[ $major =~ ^[0-9]+$ && $minor =~ ^[0-9]+$ ]] || return 0
	((major < 3 || (major == 3 && minor < 12)))
}

write_config() {
	local amqp mgmt dist tls tls_dir="${QLM_RABBITMQ_TLS_DIR:-}"
	read -r amqp mgmt dist tls < <(pick_ports "${1:-1}")
	mkdir -p "$STATE"/{home,mnesia,log,conf.d}
	printf 'AMQP_PORT=%s\nMGMT_PORT=%s\nDIST_PORT=%s\nTLS_PORT=%s\n' "$amqp" "$mgmt" "$dist" "$tls" \
		>"$STATE/ports"
	rm -f "$STATE/tls"
	if [[ -n $tls_dir ]]; then
		tls_dir="$(realpath "$tls_dir")"
		local f
		for f in cert.pem key.pem ca.pem; do
			[[ -r $tls_dir/$f ]] || die "QLM_RABBITMQ_TLS_DIR: $tls_dir/$f is missing"
		done
		touch "$STATE/tls"
	fi
	if [[ ! -s $STATE/home/.erlang.cookie ]]; then
		(
			umask 077
			python3 -c 'import secrets; print(secrets.token_hex(16), end="")' \
				>"$STATE/home/.erlang.cookie"
		)
		chmod 400 "$STATE/home/.erlang.cookie"
	fi
	{
		cat "$REPO_ROOT/docker/rabbitmq.conf"
		if needs_global_consumer_timeout; then
			printf '\n'
			cat "$REPO_ROOT/docker/rabbitmq-pre-3.12.conf"
		fi
		printf '\n# --- appended by scripts/rabbitmq-local.sh: loopback only, private ports ---\n'
		printf 'listeners.tcp.default = 127.0.0.1:%s\n' "$amqp"
		printf 'management.tcp.ip = 127.0.0.1\n'
		printf 'management.tcp.port = %s\n' "$mgmt"
		printf 'log.file.level = info\n'
		printf 'log.console = false\n'
		if [[ -n $tls_dir ]]; then
			printf 'listeners.ssl.default = 127.0.0.1:%s\n' "$tls"
			printf 'ssl_options.cacertfile = %s/ca.pem\n' "$tls_dir"
			printf 'ssl_options.certfile = %s/cert.pem\n' "$tls_dir"
			printf 'ssl_options.keyfile = %s/key.pem\n' "$tls_dir"
			printf 'ssl_options.verify = verify_none\n'
			printf 'ssl_options.fail_if_no_peer_cert = false\n'
		fi
	} >"$STATE/rabbitmq.conf"
	cp "$REPO_ROOT/docker/enabled_plugins" "$STATE/enabled_plugins"
}

wait_ready() {
	local deadline=$((SECONDS + START_TIMEOUT_S)) pid
	pid="$1"
	# `await_startup` fails at once while the node is not yet registered in epmd, so wait for
	# that first. Each CLI call costs ~0.5 s of CPU, so poll epmd (cheap) before the CLI.
	until grep -q "^name ${NODE%@*} " <<<"$(epmd -names 2>/dev/null)"; do
		kill -0 "$pid" 2>/dev/null || return 1
		((SECONDS < deadline)) || return 1
		sleep 0.1
	done
	until rabbitmq-diagnostics -q ping >/dev/null 2>&1; do
		kill -0 "$pid" 2>/dev/null || return 1
		((SECONDS < deadline)) || return 1
		sleep 0.3
	done
	rabbitmqctl -q await_startup --timeout "$START_TIMEOUT_S" >/dev/null || return 1
	read_ports
	until tcp_open "$AMQP_PORT"; do
		((SECONDS < deadline)) || return 1
		sleep 0.1
	done
}

tls_url() { printf 'amqps://guest:guest@localhost:%s/\n' "$TLS_PORT"; }

publish_urls() {
	amqp_url >"$STATE/url"
	if [[ -f $STATE/tls ]]; then
		local deadline=$((SECONDS + 15))
		until tcp_open "$TLS_PORT"; do
			((SECONDS < deadline)) || die "the TLS listener on $TLS_PORT did not open (see $STATE/log)"
			sleep 0.1
		done
		tls_url >"$STATE/tls_url"
	fi
	printf 'http://127.0.0.1:%s/\n' "$MGMT_PORT" >"$STATE/management_url"
}

cmd_up() {
	install_rabbitmq
	mkdir -p "$STATE"
	exec 9>"$STATE/lock"
	flock 9 # concurrent `up`s in one checkout start one node
	if is_running; then
		log "already running: node $NODE"
		amqp_url
		return 0
	fi
	local pid
	if pid="$(node_pid)"; then
		# Still booting (an earlier `up` was interrupted): wait for it instead of a second node.
		log "node $NODE (pid $pid) is alive but not ready yet; waiting"
		node_env
		wait_ready "$pid" || die "node $NODE does not become ready; see $STATE/log or run '$0 down'"
		publish_urls
		amqp_url
		return 0
	fi
	local t0=$SECONDS attempt launcher
	for attempt in 1 2 3; do
		write_config "$attempt"
		node_env
		log "starting node $NODE (AMQP $AMQP_PORT, management $MGMT_PORT, dist $DIST_PORT) in $STATE"
		# Not -detached: keeping stdout shows boot errors that happen before logging starts.
		# setsid + redirected fds: the node outlives this script and holds none of its pipes,
		# nor the lock (fd 9).
		(cd "$STATE" && exec setsid nohup rabbitmq-server >"$STATE/log/stdout.log" 2>&1 </dev/null 9>&-) &
		launcher=$!
		wait_ready "$launcher" && break
		if kill -0 "$launcher" 2>/dev/null || ((attempt == 3)); then
			log "node did not become ready; its first errors:"
			grep -m 8 -iE 'error|failed|eaddrinuse' "$STATE/log/stdout.log" >&2 || true
			cmd_down || true
			die "node $NODE failed to start (logs in $STATE/log)"
		fi
		# The node died during boot, e.g. a probed port was taken meanwhile: new ports, again.
		log "node exited during boot (attempt $attempt); retrying with new ports"
	done
	publish_urls
	log "ready in $((SECONDS - t0))s"
	amqp_url
}

# epmd (shared, port 4369) outlives the nodes; stop it only when no node is left in it.
maybe_kill_epmd() {
	local names
	names="$(ERL_EPMD_ADDRESS=127.0.0.1 epmd -names 2>/dev/null)" || return 0
	if ! grep -q '^name ' <<<"$names"; then
		epmd -kill >/dev/null 2>&1 || true
	fi
}

cmd_down() {
	[[ -d $STATE ]] || return 0
	local pid
	if [[ -x $RMQ_BIN/rabbitmqctl ]] && pid="$(node_pid)"; then
		node_env
		log "stopping node $NODE"
		# The management plugin's rabbit_event handler stalls `shutdown` for exactly 5 s (a call
		# timeout while rabbit stops); removing it first makes the stop take ~2.5 s instead of 7.5.
		rabbitmqctl -q eval \
			'catch gen_event:delete_handler(rabbit_event, rabbit_mgmt_db_handler, []).' \
			>/dev/null 2>&1 || true
		if ! rabbitmqctl -q shutdown >/dev/null 2>&1; then
			log "rabbitmqctl shutdown failed; sending SIGTERM to $pid"
			kill -TERM "$pid" 2>/dev/null || true
		fi
		local deadline=$((SECONDS + 30))
		while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
		if kill -0 "$pid" 2>/dev/null; then
			log "node still alive after 30 s; killing $pid"
			kill -KILL "$pid" 2>/dev/null || true
		fi
	fi
	rm -f "$STATE/url" "$STATE/tls_url" "$STATE/management_url" "$STATE/rabbitmq.pid"
	command -v epmd >/dev/null && maybe_kill_epmd
	return 0
}

# Chaos testing: the node dies at once (SIGKILL), as in a crash or a pulled cable; `up` starts
# it again on the same ports with the same state.
cmd_kill() {
	local pid
	pid="$(node_pid)" || die "not running"
	log "killing node $NODE (pid $pid) with SIGKILL"
	kill -KILL "$pid"
	while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
	rm -f "$STATE/url" "$STATE/tls_url" "$STATE/management_url" "$STATE/rabbitmq.pid"
}

cmd_status() {
	if is_running; then
		log "running: node $NODE, $(amqp_url)"
		return 0
	fi
	log "not running (state dir $STATE)"
	return 1
}

cmd_url() {
	is_running || die "not running; start it with: $0 up"
	amqp_url
}

cmd_tls_url() {
	is_running || die "not running; start it with: $0 up"
	[[ -f $STATE/tls ]] || die "started without QLM_RABBITMQ_TLS_DIR: no TLS listener"
	tls_url
}

cmd_management_url() {
	is_running || die "not running; start it with: $0 up"
	printf 'http://127.0.0.1:%s/\n' "$MGMT_PORT"
}

run_cli() {
	local tool="$1"
	shift
	[[ -x $RMQ_BIN/$tool ]] || die "$RMQ_BIN/$tool is missing"
	node_env
	exec "$RMQ_BIN/$tool" "$@"
}

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
kill) cmd_kill ;;
status) cmd_status ;;
url) cmd_url ;;
management-url) cmd_management_url ;;
tls-url) cmd_tls_url ;;
nodename) printf '%s\n' "$NODE" ;;
version) server_version ;;
clean) cmd_down && rm -rf "$STATE" ;;
ctl) shift && run_cli rabbitmqctl "$@" ;;
diag) shift && run_cli rabbitmq-diagnostics "$@" ;;
queues) shift && run_cli rabbitmq-queues "$@" ;;
*)
	echo "usage: $0 up|down|kill|status|url|tls-url|management-url|nodename|version|clean|ctl ARGS|diag ARGS|queues ARGS" >&2
	exit 2
	;;
esac
