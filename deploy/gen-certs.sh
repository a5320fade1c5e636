#!/bin/sh
# A CA and one certificate for every node (cache1..3, meta1..3, localhost, 127.0.0.1), for
# deploy/docker-compose.yml: writes DIR/ca.crt (give it to clients as tls_ca) and DIR/server.{crt,key}.
#   deploy/gen-certs.sh deploy/certs
set -eu
dir=${1:?usage: gen-certs.sh DIR}
mkdir -p "$dir"
cd "$dir"
openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=cachesvc CA" -keyout ca.key -out ca.crt
openssl req -newkey rsa:2048 -nodes -subj "/CN=cachesvc" -keyout server.key -out server.csr
printf 'subjectAltName=DNS:cache1,DNS:cache2,DNS:cache3,DNS:meta1,DNS:meta2,DNS:meta3,DNS:localhost,IP:127.0.0.1\n' > san.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -extfile san.ext -out server.crt
rm -f server.csr san.ext ca.srl
chmod 0644 server.key   # read by the container's unprivileged user (uid 10001)
