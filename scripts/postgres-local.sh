#!/usr/bin/env bash
# A private PostgreSQL cluster for development, tests and CI: no system service.
#
#   scripts/postgres-local.sh up      initdb (first time) + start (idempotent); prints the URL
#   scripts/postgres-local.sh down    stop (fast mode)
#   scripts/postgres-local.sh status  exit 0 when running and accepting connections
#   scripts/postgres-local.sh url     print postgresql+asyncpg://postgres@127.0.0.1:PORT/qlm
#   scripts/postgres-local.sh clean   stop and delete all state (the cluster's data too)
#
# State lives in $QLM_HOME/postgres (QLM_HOME defaults to <repo>/.qlm). The server listens on
# 127.0.0.1 only, on a free port picked at `up` time, with trust auth and fsync=off (test data
# only). initdb refuses to run as root, so as root the cluster belongs to the `postgres` user.
# Logs go to stderr; only the URL goes to stdout.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QLM_HOME="$(realpath -m "${QLM_HOME:-$REPO_ROOT/.qlm}")"
STATE="$QLM_HOME/postgres"
DATABASE=qlm

log() { printf '[postgres-local] %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

pg_bindir() {
	local d
	d="$(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V | tail -n 1)"
	[[ -n $d && -x $d/initdb ]] && printf '%s\n' "$d"
}

install_postgres() {
	pg_bindir >/dev/null && return 0
	if [[ $(id -u) -ne 0 ]]; then
		die "PostgreSQL is not installed (/usr/lib/postgresql/*/bin/initdb missing) and we are not" \
			"root. Install it with: sudo apt-get install -y postgresql (or set QLM_POSTGRES_URL)"
	fi
	log "installing postgresql with apt-get (one-time)"
	# The postinst must not start the system-wide cluster: refuse service starts during the
	# install unless the machine already has a policy.
	local policy=/usr/sbin/policy-rc.d added_policy=0
	if [[ ! -e $policy ]]; then
		printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && added_policy=1
	fi
	local rc=0
	{
		DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql
	} </dev/null >&2 || rc=$?
	[[ $added_policy -eq 1 ]] && rm -f "$policy"
	[[ $rc -eq 0 ]] || die "apt-get install postgresql failed (rc=$rc)"
	pg_bindir >/dev/null || die "apt installed postgresql but no initdb was found"
}

# Run a server-side command as the cluster's owner.
as_owner() {
	if [[ $(id -u) -eq 0 ]]; then
		runuser -u postgres -- "$@"
	else
		"$@"
	fi
}

# The cluster directory must be reachable by the `postgres` user. When the checkout sits under
# a directory it cannot traverse (e.g. /root), fall back to a private directory in /tmp.
make_owned_dir() {
	mkdir -p "$1"
	if [[ $(id -u) -eq 0 ]]; then
		chown postgres:postgres "$1"
		chmod 700 "$1"
	fi
}

cluster_dir() {
	local dir
	if [[ -f $STATE/cluster_dir ]]; then
		dir="$(cat "$STATE/cluster_dir")"
		make_owned_dir "$dir" # a /tmp fallback may have been wiped since
		printf '%s\n' "$dir"
		return 0
	fi
	dir="$STATE/cluster"
	make_owned_dir "$dir"
	if [[ $(id -u) -eq 0 ]] && ! runuser -u postgres -- test -w "$dir" 2>/dev/null; then
		rmdir "$dir"
		dir="/tmp/qlm-postgres-$(printf '%s' "$STATE" | sha256sum | cut -c1-10)"
		log "user postgres cannot reach $STATE; using $dir for the cluster"
		make_owned_dir "$dir"
	fi
	printf '%s\n' "$dir" >"$STATE/cluster_dir"
	printf '%s\n' "$dir"
}

# Unix socket paths are limited to 107 bytes; a deep checkout would overflow them.
socket_dir() {
	local dir="$1/sock"
	if ((${#dir} + 20 > 100)); then
		dir="/tmp/qlm-pgsock-$(printf '%s' "$STATE" | sha256sum | cut -c1-10)"
	fi
	printf '%s\n' "$dir"
}

free_port() {
	python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

url() { printf 'postgresql+asyncpg://postgres@127.0.0.1:%s/%s\n' "$1" "$DATABASE"; }

is_running() {
	local bin cdir port
	bin="$(pg_bindir)" || return 1
	[[ -f $STATE/cluster_dir && -f $STATE/port ]] || return 1
	cdir="$(cat "$STATE/cluster_dir")"
	port="$(cat "$STATE/port")"
	[[ -f $cdir/data/postmaster.pid ]] || return 1
	as_owner "$bin/pg_ctl" -D "$cdir/data" status >/dev/null 2>&1 || return 1
	"$bin/pg_isready" -q -h 127.0.0.1 -p "$port" -t 2
}

cmd_up() {
	install_postgres
	mkdir -p "$STATE"
	exec 9>"$STATE/lock"
	flock 9 # concurrent `up`s in one checkout start one server
	if is_running; then
		log "already running"
		url "$(cat "$STATE/port")"
		return 0
	fi
	local bin cdir sock port t0=$SECONDS
	bin="$(pg_bindir)"
	cdir="$(cluster_dir)"
	sock="$(socket_dir "$cdir")"
	as_owner mkdir -p "$sock"
	if [[ ! -f $cdir/data/PG_VERSION ]]; then
		log "initdb in $cdir/data"
		as_owner "$bin/initdb" -D "$cdir/data" -U postgres --auth=trust -E UTF8 --locale=C \
			--no-sync >"$STATE/initdb.log" 2>&1 ||
			{
				cat "$STATE/initdb.log" >&2
				die "initdb failed"
			}
	fi
	local attempt
	for attempt in 1 2 3; do
		port="$(free_port)"
		log "starting PostgreSQL on 127.0.0.1:$port (cluster $cdir)"
		# fd 9 (the lock) must not leak into the server, or the next `up` would wait forever.
		as_owner "$bin/pg_ctl" -D "$cdir/data" -l "$cdir/postgres.log" -w -t 60 \
			-o "-p $port -k $sock -c listen_addresses=127.0.0.1 -c fsync=off \
-c synchronous_commit=off -c full_page_writes=off" start >/dev/null 9>&- && break
		tail -n 20 "$cdir/postgres.log" >&2 || true
		((attempt < 3)) || die "pg_ctl start failed (log: $cdir/postgres.log)"
		# Most likely the probed port was taken meanwhile: try another one.
		log "pg_ctl start failed (attempt $attempt); retrying on another port"
	done
	printf '%s\n' "$port" >"$STATE/port"
	if [[ -z $("$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -tAc \
		"SELECT 1 FROM pg_database WHERE datname = '$DATABASE'") ]]; then
		"$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres "$DATABASE"
	fi
	url "$port" >"$STATE/url"
	log "ready in $((SECONDS - t0))s"
	url "$port"
}

cmd_down() {
	local bin cdir
	[[ -f $STATE/cluster_dir ]] || return 0
	bin="$(pg_bindir)" || return 0
	cdir="$(cat "$STATE/cluster_dir")"
	if [[ -f $cdir/data/postmaster.pid ]] &&
		as_owner "$bin/pg_ctl" -D "$cdir/data" status >/dev/null 2>&1; then
		log "stopping PostgreSQL (cluster $cdir)"
		as_owner "$bin/pg_ctl" -D "$cdir/data" -m fast -w -t 60 stop >/dev/null
	fi
	rm -f "$STATE/url"
}

cmd_status() {
	if is_running; then
		log "running: $(url "$(cat "$STATE/port")")"
		return 0
	fi
	log "not running (state dir $STATE)"
	return 1
}

cmd_url() {
	is_running || die "not running; start it with: $0 up"
	url "$(cat "$STATE/port")"
}

cmd_clean() {
	cmd_down
	if [[ -f $STATE/cluster_dir ]]; then
		local cdir
		cdir="$(cat "$STATE/cluster_dir")"
		rm -rf "$cdir" "$(socket_dir "$cdir")"
	fi
	rm -rf "$STATE"
}

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
status) cmd_status ;;
url) cmd_url ;;
clean) cmd_clean ;;
*)
	echo "usage: $0 up|down|status|url|clean" >&2
	exit 2
	;;
esac
