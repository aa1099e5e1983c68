// Anchor translation unit so the precompiled-header target has something to compile.
int dtune_pch_anchor() {
    return 0;
}
