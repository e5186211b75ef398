#!/usr/bin/env bash
# Test certificates for mutual TLS, made in the current folder (tests/integration/tls_test.cc,
# tests/python/test_gradsync.py): a CA "ca" signing node0, node1, tool and trainer, and another
# CA "other" signing stranger. Each leaf names 127.0.0.1 and localhost and may serve and connect
# (a daemon does both). Keys are mode 600. Files: <name>.pem, <name>.key.
set -e
ca() {
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj "/CN=gradsync test $1" -keyout "$1.key" -out "$1.pem" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
}
leaf() {
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -subj "/CN=gradsync test $1" -keyout "$1.key" -out "$1.csr"
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial -days 1 \
    -extfile "$1.ext" -out "$1.pem"
  chmod 600 "$1.key"
}
ca ca; ca other
leaf node0 ca; leaf node1 ca; leaf tool ca; leaf trainer ca; leaf stranger other
