#!/usr/bin/env bash
# A qlm producer in bash: publish one request through the RabbitMQ management HTTP API and wait
# for its one reply. Shows that the wire protocol needs nothing from Python (see docs/protocol.md).
#
#   examples/producer.sh [REQUEST.json | -]      no argument: a small sample request
#
# Environment:
#   QLM_MGMT_URL        management API, credentials in the URL (default
#                       http://guest:guest@127.0.0.1:15672; QLM_MANAGEMENT_URL is also read)
#   QLM_VHOST           virtual host (default /)
#   QLM_TIMEOUT_S       seconds to wait for the reply (default 60)
#   QLM_POLL_S          seconds between polls of the reply queue (default 0.2)
#   QLM_REPLY_QUEUE     reply queue name (default qlm.reply.sh.<request_id>); declared here and
#                       deleted on exit
#
# Prints the reply JSON on stdout. Exit status: 0 result, 3 error reply, 4 no reply in time,
# 1 anything else. Needs bash, curl and jq.
#
# The management API is fine for a demo and for scripts; a production producer should speak
# AMQP 0-9-1 with publisher confirms (the HTTP publish reports only whether it was routed).
set -euo pipefail

log() { printf '[producer.sh] %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}
for tool in curl jq; do command -v "$tool" >/dev/null || die "$tool is required"; done

MGMT="${QLM_MGMT_URL:-${QLM_MANAGEMENT_URL:-http://guest:guest@127.0.0.1:15672}}"
MGMT="${MGMT%/}"
VHOST="${QLM_VHOST:-/}"
TIMEOUT_S="${QLM_TIMEOUT_S:-60}"
POLL_S="${QLM_POLL_S:-0.2}"
vhost="$(jq -rn --arg v "$VHOST" '$v | @uri')"

CURL=(curl -sS --fail-with-body --max-time 30 -H 'content-type: application/json')
# Credentials in the URL are used by curl directly; otherwise the broker's default user.
[[ $MGMT == *@* ]] || CURL+=(-u "${QLM_MGMT_USER:-guest}:${QLM_MGMT_PASSWORD:-guest}")
api() {
	if [[ $# -gt 2 ]]; then
		"${CURL[@]}" -X "$1" "$MGMT/api/$2" --data-binary "$3"
	else
		"${CURL[@]}" -X "$1" "$MGMT/api/$2"
	fi
}

# --- the request -----------------------------------------------------------------------------
if [[ $# -gt 0 ]]; then
	if [[ $1 == - ]]; then request="$(cat)"; else request="$(cat -- "$1")"; fi
else
	request="$(jq -cn --arg id "sh-$(date +%s)-$RANDOM$RANDOM" '{
		request_id: $id, model: "mistral-7b", prompt: "Say hello in five words.",
		max_tokens: 16, slo: {e2e_ms: 30000, slo_class: "interactive"}}')"
fi
request="$(jq -c . <<<"$request")" || die "the request is not JSON"
request_id="$(jq -er '.request_id | strings' <<<"$request")" || die "the request has no request_id"
reply_queue="${QLM_REPLY_QUEUE:-qlm.reply.sh.$request_id}"
qname="$(jq -rn --arg q "$reply_queue" '$q | @uri')"

# --- the reply queue -------------------------------------------------------------------------
# HTTP cannot hold an exclusive queue (no connection owns it), so: non-durable, deleted on exit,
# and x-expires as a backstop should this script be killed before it can delete it.
expires_ms=$(awk -v t="$TIMEOUT_S" 'BEGIN { printf "%d", (t + 300) * 1000 }')
api PUT "queues/$vhost/$qname" \
	"{\"durable\": false, \"auto_delete\": false, \"arguments\": {\"x-expires\": $expires_ms}}" \
	>/dev/null || die "cannot declare reply queue $reply_queue"
cleanup() { api DELETE "queues/$vhost/$qname" >/dev/null 2>&1 || true; }
trap cleanup EXIT

# --- publish ---------------------------------------------------------------------------------
# Routing key = request_id: the consistent-hash exchange picks the shard from it.
publish="$(jq -cn --arg body "$request" --arg id "$request_id" --arg rq "$reply_queue" '{
	routing_key: $id, payload: $body, payload_encoding: "string",
	properties: {content_type: "application/json", content_encoding: "utf-8",
		delivery_mode: 2, message_id: $id, correlation_id: $id, reply_to: $rq}}')"
routed="$(api POST "exchanges/$vhost/qlm.ingress/publish" "$publish")" ||
	die "publish failed (is the coordinator's topology declared? $routed)"
[[ "$(jq -r .routed <<<"$routed")" == true ]] || die "qlm.ingress did not route the message"
log "published $request_id; waiting up to ${TIMEOUT_S}s on $reply_queue"

# --- wait for the reply ----------------------------------------------------------------------
get='{"count": 1, "ackmode": "ack_requeue_false", "encoding": "auto", "truncate": 52428800}'
# Microseconds since the epoch (bash 5's EPOCHREALTIME; whole seconds on older bash).
now_us() { if [[ -n ${EPOCHREALTIME:-} ]]; then echo "${EPOCHREALTIME/[.,]/}"; else echo "$(date +%s)000000"; fi; }
deadline=$(($(now_us) + $(awk -v t="$TIMEOUT_S" 'BEGIN { printf "%d", t * 1000000 }')))
while (($(now_us) < deadline)); do
	got="$(api POST "queues/$vhost/$qname/get" "$get")" || die "polling $reply_queue failed"
	if [[ "$(jq length <<<"$got")" -gt 0 ]]; then
		cid="$(jq -r '.[0].properties.correlation_id // empty' <<<"$got")"
		if [[ $cid != "$request_id" ]]; then
			log "ignoring a reply for correlation id '$cid'"
			continue
		fi
		[[ "$(jq -r '.[0].payload_encoding' <<<"$got")" == string ]] ||
			die "the reply is not UTF-8 text"
		reply="$(jq -r '.[0].payload' <<<"$got")"
		jq . <<<"$reply"
		[[ "$(jq -r '.type' <<<"$reply")" == result ]] && exit 0
		exit 3
	fi
	sleep "$POLL_S"
done
log "no reply for $request_id within ${TIMEOUT_S}s"
exit 4
