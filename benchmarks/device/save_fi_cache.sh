# Packs the FlashInfer modules JIT-built in this call (AOT layout: NAME/NAME.so) into one
# .tar.xz split in 15 MB parts under $OUT (carry them back as .device/fiaot/).
d=$(ls -d /tmp/fiws/.cache/flashinfer/*/*/cached_ops 2>/dev/null | head -1)
[ -n "$d" ] || { echo "no FlashInfer JIT cache"; exit 0; }
rm -rf /tmp/fipack; mkdir -p /tmp/fipack
for m in $(ls "$d"); do
  [ -f "$d/$m/$m.so" ] && mkdir -p /tmp/fipack/$m && cp "$d/$m/$m.so" /tmp/fipack/$m/
done
du -sh /tmp/fipack/*
tar -cJf /tmp/fiaot.tar.xz -C /tmp/fipack . && ls -la /tmp/fiaot.tar.xz
split -b 15M /tmp/fiaot.tar.xz $OUT/fiaot.part.
